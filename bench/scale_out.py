"""Scale-out: the iteration time projected for 1, 2, 4, 8 and 64 workers from measured parts (Amdahl), beside the
1- and 2-worker times measured here.

Measured on this machine, on one config (embedded defaults unless --set says otherwise), each after a warm-up
iteration:

  parts      each stage called directly: the sample, judge and score stages once whole (1 shard) and once in --shards
             shards, one after the other; the advantage, train step and checkpoint (the serial part: one process
             trains the adapter all shards sampled with) once.
  1 worker   whole iterations of `attack_run` with runtime.shards=--shards, shards one after the other in the run's
             process (runtime.task_runner=local);
  2 workers  the same with runtime.task_runner=ray on a local Ray instance of 2 CPUs (a shard per CPU).

Model: a shard of a stage cut into k shards takes a + b / k, where b is the work that splits with the prompts and a
what every shard pays whatever its size (a forward's fixed cost, loading its part, writing it); from the whole stage
T1 = a + b and the --shards shards' sum S = shards x a + b. On n workers a stage of k = max(n, --shards) shards takes
ceil(k / n) shard times. An iteration is the serial part, each sharded stage, and orchestration (Prefect's subflow
and task runs): the measured 1-worker iteration less its parts, held fixed, so the 1-worker row is the measurement
and the 2-worker row checks the model against Ray.

    python bench/scale_out.py [--shards 4] [--iterations 4] [--set data.prompts_per_iteration=16 ...]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKERS = (1, 2, 4, 8, 64)


def _config(runs_dir: str, run_id: str, shards: int, overrides: list[str], *extra: str):
    from redteam_grpo.core.config import load_config

    base = ["run.early_stop_reward=null", "run.early_stop_repetition=null", "logging.artifacts=false"]
    return load_config(
        None,
        [*base, *overrides, f"runtime.shards={shards}", f"run.runs_dir={runs_dir}", f"run.run_id={run_id}", *extra],
    )


def measure_parts(runs_dir: str, shards: int, overrides: list[str]) -> dict[str, float]:
    """Seconds of each part of iteration 1 (after a warm-up iteration 0), stages called directly, no Prefect."""
    from redteam_grpo.storage.rundir import RunDir
    from redteam_grpo.storage.stages import JUDGE, SAMPLE, SCORE
    from redteam_grpo.tasks import resources
    from redteam_grpo.tasks.advantage import advantage_stage
    from redteam_grpo.tasks.checkpoint import checkpoint_stage, initialize_stage
    from redteam_grpo.tasks.common import run_sharded_stage
    from redteam_grpo.tasks.judge import judge_shard, judgements_stats
    from redteam_grpo.tasks.sample import rollouts_stats, sample_shard
    from redteam_grpo.tasks.score import score_shard, scores_stats
    from redteam_grpo.tasks.train_step import train_step_stage

    parts: dict[str, float] = {}
    for n in (1, shards):
        run = RunDir.create(_config(runs_dir, f"parts-{n}", n, overrides, "run.iterations=2"))
        root = str(run.root)
        cfg = run.stored_config()
        initialize_stage.fn(root)
        res = resources.resources_for(root)
        policy, session = res.policy, res.session
        for iteration in (0, 1):
            for stage, shard_task, stats in (
                (SAMPLE, sample_shard, functools.partial(rollouts_stats, policy=policy)),
                (JUDGE, judge_shard, judgements_stats),
                (SCORE, score_shard, scores_stats),
            ):
                started = time.perf_counter()
                for k in range(n):
                    path, rows = shard_task.fn(root, iteration, k)
                    run.record_part(stage, iteration, k, Path(path), rows)
                parts[f"{stage.name} x{n}"] = time.perf_counter() - started
                run_sharded_stage(run, stage, iteration, cfg.runtime, shard_task, stats, session)  # records the stage
            started = time.perf_counter()
            advantage_stage.fn(root, iteration)
            train_step_stage.fn(root, iteration)
            checkpoint_stage.fn(root, iteration)
            parts["serial"] = time.perf_counter() - started
        resources.forget(root)
    return parts


def measure_iterations(runs_dir: str, run_id: str, shards: int, overrides: list[str], iterations: int, *extra):
    """Median seconds per iteration of `attack_run`, leaving out iteration 0 (warm-up, Ray's start)."""
    from redteam_grpo.flows.attack import attack_run

    stamps = [time.perf_counter()]
    cfg = _config(runs_dir, run_id, shards, overrides, f"run.iterations={iterations}", *extra)
    attack_run(config=cfg.model_dump(mode="json"), on_iteration=lambda m: stamps.append(time.perf_counter()))
    durations = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(durations[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # its telemetry write races the harness's
    from prefect.testing.utilities import prefect_test_harness

    with tempfile.TemporaryDirectory() as runs_dir, prefect_test_harness(server_startup_timeout=120):
        parts = measure_parts(runs_dir, args.shards, args.overrides)
        one = measure_iterations(runs_dir, "local", args.shards, args.overrides, args.iterations)
        two = measure_iterations(
            runs_dir,
            "ray",
            args.shards,
            args.overrides,
            args.iterations,
            "runtime.task_runner=ray",
            "runtime.ray_num_cpus=2",
        )

    s = args.shards
    model = {}
    for stage in ("sample", "judge", "score"):
        whole, split = parts[f"{stage} x1"], parts[f"{stage} x{s}"]
        fixed = max((split - whole) / (s - 1), 0.0)
        model[stage] = (fixed, whole - fixed)
    serial = parts["serial"]
    print(f"parts of one iteration (s), shards one after the other in one process, {s} shards:")
    for stage, (fixed, split) in model.items():
        print(
            f"  {stage:7s} whole {parts[f'{stage} x1']:.3f}   in {s} shards {parts[f'{stage} x{s}']:.3f}"
            f"   -> per shard {fixed:.3f} + {split:.3f} / n"
        )
    print(f"  serial  (advantage, train step, checkpoint) {serial:.3f}")
    # what the measured local iteration spends besides the parts: Prefect's subflow and task runs, one per shard
    orchestration = max(one - serial - sum(parts[f"{stage} x{s}"] for stage in model), 0.0)
    print(f"  orchestration (measured 1-worker iteration - its parts)  {orchestration:.3f}")
    print()
    print("| workers | shards | stages s / iteration | + orchestration | speedup | measured s / iteration |")
    print("|---|---|---|---|---|---|")
    base = one  # the measured 1-worker iteration: serial + orchestration + every shard one after the other
    for n in WORKERS:
        shards = max(n, s)  # as many shards as workers, at least the measured ones
        stages = serial + sum(math.ceil(shards / n) * (a + b / shards) for a, b in model.values())
        projected = stages + orchestration
        measured = {1: f"{one:.3f} (local runner)", 2: f"{two:.3f} (Ray, 2 CPUs)"}.get(n, "")
        print(f"| {n} | {shards} | {stages:.3f} | {projected:.3f} | {base / projected:.2f}x | {measured} |")
    fixed = serial + orchestration + sum(a for a, _ in model.values())
    print(
        f"\nAmdahl limit (a shard per worker, infinitely many): {base / fixed:.2f}x; of the 1-worker iteration "
        f"the serial stages are {serial / base:.0%} and orchestration {orchestration / base:.0%}. Ray's dispatch "
        "and each worker's Prefect task runs are not in the model: the measured 2-worker row shows what they add "
        "on this machine."
    )


if __name__ == "__main__":
    main()
