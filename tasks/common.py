"""The skeleton every table stage shares: skip when completed, write atomically, record in the manifest; and its
sharded form (runtime.shards), whose parts are recorded one by one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import Task

from redteam_grpo.core.config import RuntimeConfig
from redteam_grpo.storage import interrupts
from redteam_grpo.storage.location import absolute, same_place
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import Stage
from redteam_grpo.tasks.logs import stage_logger

# Each shard task with the run's retries, made once per process: `Task.with_options` builds a new Task (its key, its
# signature), ~1.5 ms, and a stage asked for it at every call. Keyed by the function too, so a task whose `fn` is
# replaced (a benchmark's timer, a test's patch) gets a copy of the new one.
_RETRYING: dict[tuple[Task, Callable[..., Any], int], Task] = {}


def with_retries(shard_task: Task, retries: int) -> Task:
    """`shard_task` with `retries` Prefect retries, the same Task object at every call for the same three."""
    key = (shard_task, shard_task.fn, retries)  # a Task hashes by identity
    if key not in _RETRYING:
        _RETRYING[key] = shard_task.with_options(retries=retries)
    return _RETRYING[key]


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

    `compute` returns the table and the stage's statistics (a record of core/metrics/registry.py's names), which the
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


class ShardError(RuntimeError):
    """Shards of a stage failed after their retries; the completed ones are recorded and kept."""


def run_sharded_stage(
    run: RunDir,
    stage: Stage,
    iteration: int,
    runtime: RuntimeConfig,
    shard_task: Task,
    stats_of: Callable[[pa.Table], Any],
    session: str,
) -> str:
    """Compute the stage's table as `runtime.shards` parts unless it is recorded completed; return its first part.

    `shard_task(run_dir, iteration, shard, session)` writes one shard's part (`run.part_path`) and returns its path
    and rows; `session` (the owner's `RunResources.session`) tells a worker whether what it cached is this run's.
    Each part is recorded in the manifest as soon as it completes, so a shard that fails (after
    `runtime.shard_retries` Prefect retries) fails the stage without losing the others, and a resumed run computes
    only the missing parts. `runtime.task_runner=ray`: the shards are submitted to the flow's task runner (a
    prefect-ray `RayTaskRunner`, `flows/runtime.py`) and run in parallel; `local`: one after the other, here.
    When every part is in place, `stats_of(table)` computes the stage's statistics once over all of them.
    """
    log = stage_logger()
    first = run.part_path(stage, iteration, 0, runtime.shards)
    if run.completed(stage, iteration):
        log.info("iteration %d: %s already completed, not recomputed", iteration, stage.name)
        return str(first)
    missing = [k for k in range(runtime.shards) if run.completed_part(stage, iteration, k) is None]
    if runtime.shards > 1:
        log.info("iteration %d: %s: %d of %d shards to compute", iteration, stage.name, len(missing), runtime.shards)
    task = with_retries(shard_task, runtime.shard_retries)
    root = str(absolute(run.root))  # a worker's working directory may be another

    def record(shard: int, result: tuple[str, int]) -> None:
        written, rows = result
        part = run.part_path(stage, iteration, shard, runtime.shards)
        if not same_place(written, part):
            raise ShardError(f"shard {shard} of {stage.name} wrote {written}, not its part {part}")
        with interrupts.recording():
            run.record_part(stage, iteration, shard, part, rows)

    if runtime.task_runner == "ray":
        from prefect.futures import as_completed
        from prefect_ray.context import remote_options

        # max_calls=0: a worker (and the models it loaded) serves shard after shard; Ray's default for a task that
        # reserves a GPU is a new process per task, which would load every model again
        with remote_options(num_cpus=runtime.shard_cpus, num_gpus=runtime.shard_gpus, max_calls=0):
            futures = {task.submit(root, iteration, k, session): k for k in missing}
        failed: list[tuple[int, BaseException]] = []
        for future in as_completed(list(futures)):
            shard = futures[future]
            try:
                result = future.result()
            except Exception as exc:  # the others go on; this one is reported below
                failed.append((shard, exc))
                continue
            record(shard, result)
        if failed:
            shard, exc = failed[0]
            raise ShardError(
                f"{len(failed)} of {runtime.shards} shards of {stage.name} of iteration {iteration} failed after "
                f"{runtime.shard_retries} retries (shard {shard}: {type(exc).__name__}: {exc}); the others are "
                f"recorded. Resume the run (redteam-grpo {run.command} --resume {run.root}) to compute only the "
                "failed ones"
            ) from exc
    else:
        for shard in missing:
            record(shard, task(root, iteration, shard, session))

    table, parts = run.read_parts(stage, iteration, runtime.shards)
    stats = stats_of(table)
    with interrupts.recording():
        run.record_done(stage, iteration, parts, parts=parts, rows=table.num_rows, stats=_as_dict(stats))
    return str(first)
