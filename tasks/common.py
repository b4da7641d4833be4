"""The skeleton every table stage shares: skip when completed, write atomically, record in the manifest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from redteam_grpo.storage import interrupts
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import Stage
from redteam_grpo.tasks.logs import stage_logger


def _as_dict(stats: Any) -> dict[str, Any]:
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)


def run_table_stage(
    run: RunDir,
    stage: Stage,
    iteration: int,
    compute: Callable[[], tuple[pa.Table, Any]],
    also_written: Sequence[Path] = (),
) -> str:
    """Compute the stage's table unless a completed, intact copy is recorded; return the file's path.

    `compute` returns the table and the stage's statistics (a record of core/metrics.py's names), which the
    manifest keeps with the stage, so the metrics row is assembled from what each stage computed once.
    `also_written`: other files `compute` writes (atomically); their checksums are recorded with the table's.
    """
    path = run.path(stage, iteration)
    if run.completed(stage, iteration):
        stage_logger().info("iteration %d: %s already completed, not recomputed", iteration, stage.name)
        return str(path)
    table, stats = compute()
    with interrupts.recording():  # a stop lands before the file is in place or after it is recorded
        run.write(stage, iteration, table)
        run.record_done(stage, iteration, [path, *also_written], rows=table.num_rows, stats=_as_dict(stats))
    return str(path)
