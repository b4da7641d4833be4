"""Lineages: a line of runs where each new run continues from the newest checkpoint of the one before.

Scheduled retraining starts a run with `run.lineage` set. At creation the run records, in `lineage.json`
(written once, atomically) and in its manifest:

- `parent_run` / `parent_checkpoint`: the newest finished run of the lineage under `run.runs_dir` (completed, or
  stopped early with stop kind `reward_target`: a run stopped for repetition has collapsed) and the name of its
  newest complete checkpoint (`iter_0007`), whose adapter becomes this run's initial adapter (none: the base
  model, generation 0). Names, not paths: a runs folder can move;
- `excluded_prompt_ids`: every prompt id the lineage's earlier runs sampled, so the new run trains on fresh
  prompts (when the source has too few left, the run says so and reuses them).

A resumed run reads the file back and so starts from the same parent and prompts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from redteam_grpo.core.config import DataConfig
from redteam_grpo.core.data.sources import Prompt
from redteam_grpo.core.names import is_component
from redteam_grpo.core.training.stopping import REWARD_TARGET
from redteam_grpo.storage.atomic import write_json_atomic
from redteam_grpo.storage.location import location
from redteam_grpo.storage.rundir import RunDir, RunDirError
from redteam_grpo.storage.stages import SAMPLE

log = logging.getLogger(__name__)

LINEAGE_FILE = "lineage.json"
MANIFEST_FIELDS = ("lineage", "generation", "parent_run", "parent_checkpoint")


class LineageError(RuntimeError):
    """A run cannot continue its lineage as recorded."""


@dataclass(frozen=True)
class LineageInfo:
    lineage: str
    generation: int
    parent_run: str | None = None
    parent_checkpoint: str | None = None
    excluded_prompt_ids: list[str] = field(default_factory=list)


def read_lineage(run: RunDir) -> LineageInfo | None:
    path = run.root / LINEAGE_FILE
    if not path.is_file():
        return None
    try:
        record = LineageInfo(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise RunDirError(f"{path} is not a valid lineage record: {exc}") from None
    for name in (record.parent_run, record.parent_checkpoint):
        if name is not None and not is_component(name):  # joined under runs_dir: it must stay there
            raise RunDirError(f"{path} names the parent {name!r}, which is not one folder name: it is damaged")
    return record


def runs_in_lineage(runs_dir: Path, lineage: str) -> list[tuple[RunDir, LineageInfo]]:
    """The runs of `lineage` under `runs_dir`, oldest generation first. An unreadable record is skipped with a
    warning: one damaged folder must not stop every scheduled run."""
    found = []
    for path in sorted(location(runs_dir).glob(f"*/{LINEAGE_FILE}")):
        try:
            run = RunDir.open(path.parent)
            info = read_lineage(run)
        except RunDirError as exc:
            log.warning("skipping %s: %s", path.parent, exc)
            continue
        if info is not None and info.lineage == lineage:
            found.append((run, info))
    return sorted(found, key=lambda item: (item[1].generation, item[0].run_id))


def can_be_parent(run: RunDir) -> bool:
    """Finished, or stopped early for reaching its reward target; any other early stop means a collapsed policy."""
    manifest = run.identity_and_status()
    status = manifest.get("status")
    return status == "completed" or (status == "early_stopped" and manifest.get("stop_kind") == REWARD_TARGET)


def parent_checkpoint_dir(run: RunDir, record: LineageInfo) -> Path | None:
    """The parent's checkpoint folder, found beside this run (wherever the runs folder is now)."""
    if record.parent_run is None or record.parent_checkpoint is None:
        return None
    return run.root.parent / record.parent_run / "checkpoints" / record.parent_checkpoint


def record_in_manifest(run: RunDir, record: LineageInfo) -> None:
    """Copy the lineage fields into the manifest (idempotent: also repairs a crash between the two writes)."""
    run.set_status(
        run.identity_and_status().get("status", "running"), **{k: getattr(record, k) for k in MANIFEST_FIELDS}
    )


def sampled_prompt_ids(run: RunDir) -> set[str]:
    """Every prompt id the run sampled, from the rollouts the manifest records."""
    ids: set[str] = set()
    for iteration in run.recorded_iterations(SAMPLE):
        ids.update(run.read(SAMPLE, iteration).column("prompt_id").to_pylist())
    return ids


def fresh_prompts(run: RunDir, prompts: list[Prompt], data: DataConfig) -> tuple[list[Prompt], str | None]:
    """The prompts a run of a lineage draws from: the source less what its earlier runs sampled, while enough
    remain; else all of them, with a warning to show."""
    record = read_lineage(run)
    if record is None or not record.excluded_prompt_ids:
        return prompts, None
    excluded = set(record.excluded_prompt_ids)
    fresh = [p for p in prompts if p.prompt_id not in excluded]
    if len(fresh) >= data.prompts_per_iteration:
        return fresh, None
    return prompts, (
        f"lineage {record.lineage!r} has sampled {len(prompts) - len(fresh)} of the {len(prompts)} prompts; "
        f"{len(fresh)} fresh ones are fewer than data.prompts_per_iteration={data.prompts_per_iteration}, so this "
        "run reuses all of them. Add prompts to continue on fresh ones."
    )


def start_in_lineage(run: RunDir, lineage: str) -> LineageInfo:
    """Record where a new run of `lineage` starts from (see the module docstring)."""
    earlier = [(r, i) for r, i in runs_in_lineage(run.root.parent, lineage) if r.root != run.root]
    excluded: set[str] = set()
    for earlier_run, _ in earlier:
        excluded |= sampled_prompt_ids(earlier_run)
    parent, parent_info, parent_checkpoint = None, None, None
    for candidate, info in reversed(earlier):
        if can_be_parent(candidate):
            newest = candidate.newest_checkpoint()
            if newest is not None:
                parent, parent_info, parent_checkpoint = candidate, info, candidate.checkpoint_dir(newest)
                break
    record = LineageInfo(
        lineage=lineage,
        generation=parent_info.generation + 1 if parent_info else 0,
        parent_run=parent.run_id if parent else None,
        parent_checkpoint=parent_checkpoint.name if parent_checkpoint else None,
        excluded_prompt_ids=sorted(excluded),
    )
    write_json_atomic(run.root / LINEAGE_FILE, asdict(record))
    record_in_manifest(run, record)
    return record
