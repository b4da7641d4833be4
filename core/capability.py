"""Capability on standard tasks, through the lm-evaluation-harness (EleutherAI's `lm_eval`, the package the field
reports with): `evaluate --capability lm-eval:arc_easy,hellaswag` scores the base and the trained model on the same
tasks, the adapter switched off for the base, so the two columns differ only by the adapter.

One task is bundled (`embedded_replies`): a 4-way multiple choice on the embedded world (which reply answers this
benign prompt), so the path runs offline on the embedded models; its numbers mean only that the path runs. Every
other name is looked up in lm-eval's own task index (a hub dataset, downloaded by lm-eval).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

SUITE = "lm-eval"
BUNDLED_TASK = "embedded_replies"
INSTALL_HINT = "pip install 'redteam-grpo[eval]' (the lm-evaluation-harness)"
REPORTED = (
    "acc",
    "acc_norm",
    "exact_match",
    "f1",
    "mc1",
    "mc2",
    "word_perplexity",
)  # the rest is lm-eval's bookkeeping


class CapabilityError(ValueError):
    """A capability option that cannot be run as given."""


def parse_capability(spec: str) -> list[str]:
    """`lm-eval:TASK[,TASK...]` → the task names, in order, once each.

    >>> parse_capability("lm-eval:arc_easy, hellaswag,arc_easy")
    ['arc_easy', 'hellaswag']
    >>> try:
    ...     parse_capability("olmes:arc")
    ... except CapabilityError as exc:
    ...     print(str(exc)[:62])
    --capability 'olmes:arc': the suite is lm-eval, as in 'lm-eval
    """
    suite, _, names = spec.partition(":")
    tasks = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    if suite.strip() != SUITE or not tasks:
        raise CapabilityError(
            f"--capability {spec!r}: the suite is {SUITE}, as in '{SUITE}:arc_easy,hellaswag' (bundled offline "
            f"task: {SUITE}:{BUNDLED_TASK})"
        )
    return tasks


def bundled_task(data_file: Path) -> dict[str, Any]:
    """The bundled task's lm-eval config: a local JSON dataset, one question, four choices, the gold index."""
    return {
        "task": BUNDLED_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},  # absolute: lm-eval resolves from the CWD
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        "target_delimiter": " ",
        "metric_list": [
            {"metric": name, "aggregation": "mean", "higher_is_better": True} for name in ("acc", "acc_norm")
        ],
        "metadata": {"version": 1.0},
    }


@contextlib.contextmanager
def _stderr_to(log: Path) -> Iterator[None]:
    """lm-eval's progress bars, warnings and `git describe` go to `log`, not to the console a person reads."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "a", encoding="utf-8") as sink, contextlib.redirect_stderr(sink):  # Python's writes and fd 2's
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sink.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _harness():
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise CapabilityError(f"--capability needs the lm-evaluation-harness: {INSTALL_HINT}") from None
    return simple_evaluate, HFLM, TaskManager


class CapabilitySuite:
    """The requested tasks, resolved once (unknown names refused before any model is scored), run on any model."""

    def __init__(self, tasks: list[str], log: Path, limit: int | None = None, batch_size: int = 8):
        self.log, self.limit, self.batch_size = log, limit, batch_size
        self._evaluate, self._model_class, task_manager = _harness()
        others = [t for t in tasks if t != BUNDLED_TASK]
        with _stderr_to(log):
            self.task_manager = task_manager(include_defaults=bool(others))
        unknown = [t for t in others if t not in self.task_manager.all_tasks]
        if unknown:
            raise CapabilityError(
                f"--capability: {', '.join(unknown)}: not an lm-eval task (`lm-eval ls tasks` lists them; bundled "
                f"offline: {BUNDLED_TASK})"
            )
        with resources.as_file(resources.files("redteam_grpo.core.resources") / "embedded_replies.jsonl") as data:
            self.specs = [bundled_task(Path(data)) if t == BUNDLED_TASK else t for t in tasks]
        for name, spec in zip(tasks, self.specs, strict=True):  # each task's dataset, before any model is scored
            try:
                with _stderr_to(log):
                    self.task_manager.load([spec])
            except Exception as exc:  # datasets' errors have no common base; the message names the one it was
                raise CapabilityError(
                    f"--capability: the dataset of lm-eval task {name} could not be loaded ({type(exc).__name__}: "
                    f"{exc}). Runs are offline by default and read datasets from the Hugging Face datasets cache: "
                    f"fetch it there once on a machine that reaches the hub (`lm-eval run --tasks {name} --limit 1`"
                    ", any model), or leave the task out"
                ) from None

    def scores(self, model: Any, tokenizer: Any) -> dict[str, dict[str, float]]:
        """{task: {metric: value}} of `model` as it is now (adapters on or off as the caller set them)."""
        with _stderr_to(self.log):
            lm = self._model_class(pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size)
            results = self._evaluate(
                model=lm,
                tasks=self.specs,
                task_manager=self.task_manager,
                limit=self.limit,
                bootstrap_iters=0,
                log_samples=False,
            )
        return {task: _metrics(values) for task, values in results["results"].items()}


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `acc,none` → `acc` (the default filter); a filtered metric keeps its filter: `exact_match,flexible`."""
    out = {}
    for key, value in values.items():
        metric, _, filter_name = key.partition(",")
        if metric in REPORTED and isinstance(value, int | float):
            out[metric if filter_name in ("", "none") else f"{metric},{filter_name}"] = float(value)
    return out
