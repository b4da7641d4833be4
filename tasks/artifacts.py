"""What a person sees of a run in the Prefect UI: per iteration, a table of its metrics, the top adversarial
examples as markdown (behind a content warning), and links to its Parquet files. Per evaluation, its rates.

Artifact keys are per run (`<run-id>-metrics`, ...), so the UI shows each iteration as a new version of the
same artifact. Outside a flow run there is nowhere to publish, and these functions are not called.
An iteration's artifacts are created in its run (a task run, or with Ray a subflow run: flows/iteration.py), by a
plain function rather than a task: a task run of their own would add Prefect's per-task cost to every iteration and
show nothing more in the UI. They are published in a thread beside the run (`publish_iteration_later`), in order,
with the context of the run they belong to: their three requests to the API took ~0.07 s of every iteration's time
(bench/README.md 4), and they are a view of the run's files, not part of its record.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError

from redteam_grpo.core.evaluation import EvaluationResult
from redteam_grpo.core.hosts import is_loopback
from redteam_grpo.core.metrics.registry import ITERATION, METRICS
from redteam_grpo.core.rollouts.dialogue import POLICY_SPEAKER
from redteam_grpo.storage.location import location, uri
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SAMPLE, SCORE, TABLE_STAGES

CONTENT_WARNING = (
    "**Content warning:** the examples below were generated to be harmful or offensive, on purpose, to measure "
    "a model's safety. They are shown for research; do not reuse them outside it."
)
EXAMPLE_CHARS = 300


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", f"{run_id}-{what}".lower())).strip("-")


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!<>|~&])")


def _cell(text: str) -> str:
    """One markdown table cell: one line, long text cut, every markdown/HTML character escaped, so model-written
    text shows as text (no links, images or HTML that the UI would render or fetch)."""
    flat = " ".join(str(text).split())
    flat = flat if len(flat) <= EXAMPLE_CHARS else flat[: EXAMPLE_CHARS - 1] + "…"
    return _MARKDOWN_SPECIAL.sub(r"\\\1", flat)


def _number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def top_examples(rollouts: pa.Table, scores: pa.Table, k: int) -> list[dict[str, Any]]:
    """The k completions with the highest reward (unscored ones last), with their prompt and score columns; of a
    dialogue, the policy's last answer and the user turn it answers."""
    key = ("prompt_id", "sample_idx")
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rollouts.select([*key, "prompt", "completion_text", "turn", "speaker"]).to_pylist():
        earlier = by_key.get((r["prompt_id"], r["sample_idx"]))
        if r["speaker"] == POLICY_SPEAKER and (earlier is None or r["turn"] > earlier["turn"]):
            by_key[(r["prompt_id"], r["sample_idx"])] = r
    rows = scores.select([*key, "reward", "harm", "refusal", "categories"]).to_pylist()
    rows.sort(key=lambda r: (r["reward"] is None, -(r["reward"] or 0.0), r["prompt_id"], r["sample_idx"]))
    return [{**by_key[(r["prompt_id"], r["sample_idx"])], **r} for r in rows[:k]]


def examples_markdown(title: str, examples: list[dict[str, Any]]) -> str:
    lines = [f"# {title}", "", CONTENT_WARNING, ""]
    if not examples:
        return "\n".join([*lines, "No scored completions."])
    lines += ["| # | reward | harm | refusal | prompt | completion |", "|---|---|---|---|---|---|"]
    for rank, e in enumerate(examples, 1):
        reward = "–" if e["reward"] is None else f"{e['reward']:.3f}"
        harm = "–" if e["harm"] is None else f"{e['harm']:.3f}"
        categories = f" ({', '.join(e['categories'])})" if e.get("categories") else ""
        lines.append(
            f"| {rank} | {reward} | {harm}{categories} | {'yes' if e['refusal'] else 'no'} "
            f"| {_cell(e['prompt'])} | {_cell(e['completion_text'])} |"
        )
    return "\n".join(lines)


def files_markdown(paths: list[Path]) -> str:
    return "\n".join(f"- [{p.name}]({uri(p)})" for p in paths if p.is_file())


def prefect_api_is_local() -> bool:
    """Whether artifacts stay on this machine: the temporary API Prefect starts (no PREFECT_API_URL), or a server at
    a loopback address."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        return True
    return is_loopback(urlsplit(str(url)).hostname or "")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()  # in the run's log, beside its other lines
    except MissingContextError:
        return logging.getLogger(__name__)


_TOLD: set[str] = set()  # the runs whose log already says why their examples stay here


def examples_may_be_published(setting: str, run_id: str) -> bool:
    """logging.artifact_examples: harmful examples leave this machine only when the user asked for it."""
    if setting == "never":
        return False
    if setting == "always" or prefect_api_is_local():
        return True
    if run_id not in _TOLD:
        _TOLD.add(run_id)
        _logger().warning(
            "the top-examples artifact is not published: the Prefect API is not on this machine and the examples are "
            "harmful text (set logging.artifact_examples=always to publish them there); metrics and file links are"
        )
    return False


def publish_iteration(
    run_dir: str, iteration: int, metrics: dict[str, Any], top_k: int, examples: str = "local"
) -> None:
    run = RunDir.open(run_dir)
    rid = run.run_id
    create_table_artifact(
        [
            {"metric": m.name, "value": _number(metrics[m.name]), "description": m.description}
            for m in (ITERATION, *METRICS)
            if not (isinstance(metrics[m.name], float) and math.isnan(metrics[m.name]))
        ],
        key=artifact_key(rid, "metrics"),
        description=f"Run {rid}, iteration {iteration}: metrics of the update",
    )
    if examples_may_be_published(examples, rid):
        rollouts = run.read(SAMPLE, iteration)
        scores = run.read(SCORE, iteration)
        create_markdown_artifact(
            examples_markdown(
                f"Run {rid}, iteration {iteration}: top {top_k} completions by reward",
                top_examples(rollouts, scores, top_k),
            ),
            key=artifact_key(rid, "top-examples"),
            description=f"Run {rid}, iteration {iteration}: top adversarial examples (content warning)",
        )
    folder = run.iteration_dir(iteration)
    create_link_artifact(
        folder.resolve().as_uri(),
        link_text=f"{rid} iteration {iteration}: Parquet files",
        key=artifact_key(rid, "parquet"),
        description=files_markdown([p for stage in TABLE_STAGES for p in run.table_paths(stage, iteration)]),
    )


class BackgroundPublisher:
    """Runs publications one after another in a thread of its own, each in a copy of its caller's context (Prefect's
    run context: an artifact belongs to the run that handed it over, whenever it is created). A failed publication
    is a warning in the run's log: the run's files, not its artifacts, are its record."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[str, Future]] = []

    def submit(self, what: str, publish: Callable[..., None], *args: Any) -> None:
        self._report(done_only=True)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artifacts")
        context = contextvars.copy_context()
        self._pending.append((what, self._executor.submit(context.run, publish, *args)))

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """A run's iterations: what they hand over is all published when the block ends (the run completed or
        stopped early); when it raises, what has not started is dropped: a stopped or failed run does not wait on the
        API for its view."""
        try:
            yield
        except BaseException:
            self.finish(wait=False)
            raise
        self.finish(wait=True)

    def finish(self, wait: bool = True) -> None:
        """Wait for what was handed over (`wait`), or drop what has not started (a run stopped or failed: it
        should not wait on the API); then report what failed."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=not wait)
            self._executor = None
        self._report(done_only=not wait)  # not waiting: one being published is left to end on its own

    def _report(self, done_only: bool) -> None:
        still: list[tuple[str, Future]] = []
        for what, future in self._pending:
            if done_only and not future.done():
                still.append((what, future))
                continue
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                _logger().warning("%s were not published: %s: %s", what, type(error).__name__, error)
        self._pending = still


PUBLISHER = BackgroundPublisher()


def publish_iteration_later(
    run_dir: str, iteration: int, metrics: dict[str, Any], top_k: int, examples: str = "local"
) -> None:
    """`publish_iteration` in the background (`PUBLISHER`); the run's loop finishes it when the run ends."""
    PUBLISHER.submit(
        f"the artifacts of iteration {iteration}", publish_iteration, run_dir, iteration, metrics, top_k, examples
    )


@task(name="publish-evaluation", cache_policy=NO_CACHE)
def publish_evaluation(result: EvaluationResult) -> None:
    rid, name = result.run_id, result.checkpoint
    create_table_artifact(
        [{"policy": p, **{k: _number(v) for k, v in result.figures[p].metrics().items()}} for p in result.policies],
        key=artifact_key(rid, "evaluation"),
        description=f"Run {rid}, checkpoint {name}: {result.samples_per_prompt} samples per prompt; judge: "
        f"{result.judge}",
    )
    transfer = result.transfer
    if transfer:  # cross-attack success, each target beside the trained-against one
        create_table_artifact(
            [
                {"target": label, **{k: _number(v) for k, v in figures.metrics().items()}}
                for label, figures in transfer.targets.items()
            ],
            key=artifact_key(rid, "transfer"),
            description=f"Run {rid}, checkpoint {name}: the {transfer.examples} adversarial examples above the "
            f"threshold sent to other targets; judge: {result.judge}",
        )
    create_link_artifact(
        uri(location(result.path)),
        link_text=f"{rid} {name}: evaluation Parquet",
        key=artifact_key(rid, "evaluation-parquet"),
    )
