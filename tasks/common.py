"""The skeleton every stage shares: skip when completed, write atomically, record in the manifest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.tasks.resources import stage_logger


def write_parquet(path: Path, table: pa.Table) -> None:
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def run_table_stage(
    run: RunDir, iteration: int, stage: str, compute: Callable[[], pa.Table], also_written: Sequence[Path] = ()
) -> str:
    """Compute the stage's table unless a completed, intact copy is recorded; return the file's path.

    `also_written`: other files `compute` writes (atomically); their checksums are recorded with the table's.
    """
    path = run.stage_path(iteration, stage)
    if run.stage_done(iteration, stage):
        stage_logger().info("iteration %d: %s already completed, not recomputed", iteration, stage)
        return str(path)
    table = compute()
    write_parquet(path, table)
    run.mark_stage_done(iteration, stage, [path, *also_written], rows=table.num_rows)
    return str(path)
