"""Synchronous against one step off-policy (training.max_staleness 0 vs 1), side by side in one run: iterations per
second of the Prefect pipeline sampling on the real vLLM engine, and the time each side waits.

The engine (`redteam-grpo serve-sampler`, vLLM's CPU build in bfloat16) is pinned to CPU core 0, the run's process
(score, advantage, train step, checkpoint) to core 1, one thread each, so the two sides compete for nothing but what
the pipeline makes them wait for. Two models: a random-weight Qwen3 of hidden 512 and 8 layers (the bench/peer_trl.py
work: 4 prompts x G 8 x 32 tokens, LoRA r16), and the embedded default. The first two iterations are left out
(warm-up; one step off-policy draws both with the initial adapter), and so is the last (it has nothing to draw ahead,
and ends in the run's end): each iteration is timed from its start to the next one's. With fewer than 8 iterations
the figures are mostly warm-up.

    python bench/off_policy.py [--models 512x8,embedded] [--iterations 8]
    python bench/off_policy.py --parity [--seeds 0,1,2] [--iterations 30] [--set KEY=VALUE]  # learning parity

Per iteration, from the stages' own start and end: `sample` (the engine's busy time), `train` (judge + score +
advantage + train step + checkpoint: the run's process's), and the waits: the engine idles while no sample stage
runs; the trainer waits for the rollouts it needs (synchronous: the whole sample stage; off-policy: the part of the
next sample stage that outlasts the update beside it). Target: off-policy / synchronous iterations per second >= 1.3
at 512x8.

The projection is arithmetic on stage times, labelled as such: synchronous, the sum of the stages; one step
off-policy, score + advantage + max(sample, train step + checkpoint + judge), the engine and the trainer on devices
of their own, as on this CPU, the judge on the trainer's; or max(sample + judge, train step + checkpoint) with the
judge on a device of its own (the reward server). It is printed for this run's measured stage times (set beside the
measured speed-up, it tells how well the pipeline realises the overlap) and for bench/README.md section 8's
projected (not measured) H100 stage times of the shipped attack config.

--parity: learning parity on the embedded default (bfloat16, on the engine), per seed: synchronous, one step
off-policy, and a control that trains the stale batches without the correction (every factor 1); the rise of each
(the last 5 iterations' mean reward less the first 5's, as tests/flows/test_learning.py), and the means over the run
of the train step's diagnostics (KL(behaviour ‖ current) as sampler_kl, the share of tokens the correction capped,
the reward's KL to the base); `--save FILE` keeps them per iteration. `--set KEY=VALUE` changes every run's config.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]
ENGINE_CORE, TRAINER_CORE = 0, 1
# the run's process: the judge too (in-process scorers), whether it runs in its iteration or ahead beside an update
TRAINER_STAGES = ("judge", "score", "advantage", "train_step", "checkpoint")


def start_pinned_engine(engine_env: Path, model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """serve-sampler on `model` in bfloat16, its process tree on ENGINE_CORE with one OpenMP thread bound there."""
    from gpu_sampling import start_engine

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE), "OMP_NUM_THREADS": "1"}
    pin = lambda: os.sched_setaffinity(0, {ENGINE_CORE})  # noqa: E731
    return start_engine(engine_env, model, "bfloat16", log, kv_cache_gib=2, env=env, preexec_fn=pin)


def child(iterations: int, overrides: list[str], uncorrected: bool = False) -> dict:
    """One run in this process (pinned to TRAINER_CORE); each stage's (iteration, start, end) and each iteration's
    start, from wrappers around the stages the iteration flow runs (the sample stage ahead included), and each
    iteration's mean reward. `uncorrected`: the control, every correction factor 1 (the stale batch trained as if
    on-policy), patched here: no config asks for it."""
    from orchestration import bench_run

    from redteam_grpo.flows import attack
    from redteam_grpo.flows import iteration as flow
    from redteam_grpo.storage.rundir import RunDir
    from redteam_grpo.storage.stages import TRAIN_STEP

    os.sched_setaffinity(0, {TRAINER_CORE})
    if uncorrected:
        import torch

        from redteam_grpo.core.training import train

        train.mismatch_weights = lambda old, sample, mask, *rest: (torch.ones_like(old), torch.zeros_like(mask))
    spans: list[tuple[str, int, float, float]] = []
    starts: list[float] = []

    def timed(name, run):
        def stage(run_dir, number):
            began = time.perf_counter()
            try:
                return run(run_dir, number)
            finally:
                spans.append((name, number, began, time.perf_counter()))

        return stage

    for name in ("sample", *TRAINER_STAGES):
        flow.STAGE_TASKS[name] = timed(name, flow.STAGE_TASKS[name])
    body = flow.run_iteration

    def marked(run_dir, run_id, iteration):  # the parameter names of the task run's name
        starts.append(time.perf_counter())
        return body(run_dir, run_id, iteration)

    flow.iteration_task.fn = marked
    with tempfile.TemporaryDirectory() as runs:
        attack.attack_run(overrides=[*overrides, *bench_run(iterations, runs)])
        run = RunDir.open(Path(runs) / "bench")
        rows = [run.read(TRAIN_STEP, i).to_pylist()[0] for i in range(iterations)]
    metrics = {name: [row.get(name) for row in rows] for name in DIAGNOSTICS}
    return {"starts": starts, "spans": spans, "rewards": [row["reward_mean"] for row in rows], **metrics}


def summary(result: dict, warmup: int = 2) -> dict[str, float]:
    """Seconds per iteration after `warmup`, from its start to the last iteration's start: wall, each stage's (the
    stages that began in that window), and each side's wait. The last iteration is left out, as in bench/peer_trl.py:
    it ends in the run's end (the Prefect flow run completing, ~0.5 s once a run), which no iteration costs."""
    starts = result["starts"]
    begin, stop, n = starts[warmup], starts[-1], len(starts) - 1 - warmup
    if n < 1:
        raise SystemExit(f"measure at least {warmup + 2} iterations: {warmup} warm-up, 1 measured, the last left out")
    spans = [(name, i, a, b) for name, i, a, b in result["spans"] if begin <= a < stop]
    stage = {name: sum(b - a for s, _, a, b in spans if s == name) / n for name in ("sample", *TRAINER_STAGES)}
    wall = (stop - begin) / n
    train = sum(stage[name] for name in TRAINER_STAGES)
    return {"wall": wall, **stage, "engine waits": wall - stage["sample"], "trainer waits": wall - train}


def projected(stage: dict[str, float], judge_apart: bool = False) -> tuple[float, float]:
    """Seconds per iteration synchronous and one step off-policy, from stage times, with the engine and the trainer on
    devices of their own: off-policy, iteration i + 1's sample and judge run beside iteration i's train step and
    checkpoint. `judge_apart`: the judge on a device of its own (the reward server), reading each batch after the
    engine drew it; else on the trainer's, whose time it takes wherever it runs."""
    synchronous = stage["sample"] + sum(stage[name] for name in TRAINER_STAGES)
    update = stage["train_step"] + stage["checkpoint"]
    if judge_apart:
        beside = max(stage["sample"] + stage["judge"], update)
    else:
        beside = max(stage["sample"], update + stage["judge"])
    return synchronous, stage["score"] + stage["advantage"] + beside


# bench/README.md section 8's projection (not a measurement) of one iteration of the shipped attack config on one H100
# at 40 % MFU, in seconds: sampling 4-6.5 (the middle), score 14.0 (the DeBERTa-v3-large scorer's 0.29 PFLOP of it is
# the judge stage's 0.7 s), train step 13.3, checkpoint and orchestration 1.5
H100_PROJECTED = {"sample": 5.25, "judge": 0.7, "score": 13.3, "advantage": 0.0, "train_step": 13.3, "checkpoint": 1.5}


def run_child(iterations: int, overrides: list[str], uncorrected: bool = False) -> dict:
    from peer_trl import child_env

    with tempfile.TemporaryDirectory() as home:
        spec = {"iterations": iterations, "overrides": overrides, "uncorrected": uncorrected}
        command = [sys.executable, __file__, "--child", json.dumps(spec)]
        result = subprocess.run(command, capture_output=True, text=True, env=child_env(home))
    if result.returncode != 0:
        raise SystemExit(f"the run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def mean_of(values: list) -> float:
    """The mean of the finite values (a metric not measured at an iteration is None or NaN there); NaN if none."""
    finite = [v for v in values if v is not None and v == v]
    return sum(finite) / len(finite) if finite else float("nan")


def rise(rewards: list[float]) -> float:
    """The last 5 iterations' mean reward less the first 5's (tests/flows/test_learning.py)."""
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


# per iteration, from the train step's record: the parity runs print their means beside the rewards
DIAGNOSTICS = ("harm_mean", "sampler_kl", "correction_token_share", "grad_norm", "kl_base_mean")
KINDS = {"synchronous": (0, False), "off-policy": (1, False), "uncorrected": (1, True)}  # staleness, uncorrected


def parity(args) -> None:
    """The embedded default on the engine for `--iterations` (30 with --parity unless given) per seed: synchronous,
    one step off-policy, and one step off-policy without the correction (the control); each one's rise."""
    from rich.console import Console
    from rich.table import Table

    iterations = args.iterations if args.iterations != 8 else 30
    seeds = [int(s) for s in args.seeds.split(",")]
    console = Console()
    kinds = {kind: KINDS[kind] for kind in args.kinds.split(",")}
    rises: dict[str, list[float]] = {kind: [] for kind in kinds}
    ends: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as work:
        with console.status("starting the engine ..."):
            engine, url = start_pinned_engine(Path(args.engine), "embedded:tiny-qwen3", Path(work) / "engine.log")
        try:
            for seed in seeds:
                for kind, (staleness, uncorrected) in kinds.items():
                    overrides = ["model.dtype=bfloat16", "sampling.backend=vllm", f"sampling.vllm_url={url}"]
                    overrides += [f"training.max_staleness={staleness}", f"run.seed={seed}", *args.set]
                    with console.status(f"seed {seed}: {kind}, {iterations} iterations ..."):
                        result = run_child(iterations, overrides, uncorrected)
                    if args.save:  # every iteration's reward and diagnostics, for a closer look than the means
                        record = {"seed": seed, "kind": kind, "settings": args.set, "rewards": result["rewards"]}
                        record |= {name: result.get(name) for name in DIAGNOSTICS}
                        with open(args.save, "a") as saved:
                            saved.write(json.dumps(record) + "\n")
                    rises[kind].append(rise(result["rewards"]))
                    ends[kind].append(sum(result["rewards"][-5:]) / 5)
                    console.print(f"seed {seed} {kind}: rewards " + " ".join(f"{r:.2f}" for r in result["rewards"]))
                    means = {name: mean_of(result.get(name, [])) for name in DIAGNOSTICS}
                    console.print("  means over the run: " + ", ".join(f"{k} {v:.3g}" for k, v in means.items()))
        finally:
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(60)
    settings = "".join(f", {setting}" for setting in args.set)
    title = f"reward rise (last 5 iterations' mean - first 5's), embedded default{settings}, {iterations} iterations"
    table = Table(title=title)
    for column in ("run", *(f"seed {s}" for s in seeds), "mean", "spread", "last 5 iterations' reward: mean"):
        table.add_column(column, justify="right")
    for kind, values in rises.items():
        spread = f"{min(values):.3f} .. {max(values):.3f}"
        end = sum(ends[kind]) / len(ends[kind])
        table.add_row(kind, *(f"{v:.3f}" for v in values), f"{sum(values) / len(values):.3f}", spread, f"{end:.3f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="512x8,embedded", help="HIDDENxLAYERS (a random Qwen3) or embedded")
    parser.add_argument("--iterations", type=int, default=8, help="iterations per run (the first two are warm-up)")
    parser.add_argument("--engine", default=str(ROOT / ".vllm"), help="the engine's environment (install-sampler)")
    parser.add_argument("--parity", action="store_true", help="learning parity on the embedded default instead")
    parser.add_argument("--seeds", default="0,1,2", help="--parity: the run seeds")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"--parity: which of {', '.join(KINDS)}")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="--parity: a config override for every run"
    )
    parser.add_argument("--save", metavar="FILE", help="--parity: append each run's iterations to FILE (JSON lines)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        import torch

        torch.set_num_threads(1)
        logging.disable(logging.WARNING)
        spec = json.loads(args.child)
        print(json.dumps(child(spec["iterations"], spec["overrides"], spec["uncorrected"])))
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this benchmark pins the engine and the trainer to a core each: it needs 2 CPU cores")
    if args.parity:
        parity(args)
        return

    from peer_trl import PROMPTS, build_model, ours_overrides
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    table = Table(title="s / iteration, engine on core 0, trainer on core 1, one thread each (after 2 warm-up)")
    columns = ("wall", "sample", "judge", "score", "advantage", "train_step", "checkpoint")
    columns += ("engine waits", "trainer waits")
    labels = ("wall", "sample", "judge", "score", "adv.", "train", "ckpt", "engine waits", "trainer waits")
    for column in ("model", "staleness", *labels, "speed-up"):
        table.add_column(column, justify="right")
    projections = Table(title="arithmetic on stage times, engine and trainer on devices of their own: s / iteration")
    for column in ("stage times", "synchronous", "one step off-policy", "speed-up"):
        projections.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as work:
        prompt_file = Path(work) / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        for name in args.models.split(","):
            if name == "embedded":
                model, overrides = "embedded:tiny-qwen3", []
            else:
                hidden, layers = (int(x) for x in name.split("x"))
                folder = Path(work) / f"qwen3-{name}"
                build_model(folder, hidden, layers)
                model, overrides = str(folder), [*ours_overrides(folder), f"data.source={prompt_file}"]
            with console.status(f"{name}: starting the engine on core {ENGINE_CORE} ..."):
                engine, url = start_pinned_engine(Path(args.engine), model, Path(work) / f"engine-{name}.log")
            try:
                engine_settings = ["model.dtype=bfloat16", "sampling.backend=vllm", f"sampling.vllm_url={url}"]
                rows = {}
                for staleness in (0, 1):
                    with console.status(f"{name}: {args.iterations} iterations at staleness {staleness} ..."):
                        result = run_child(
                            args.iterations, [*overrides, *engine_settings, f"training.max_staleness={staleness}"]
                        )
                    rows[staleness] = summary(result)
            finally:
                os.killpg(engine.pid, signal.SIGTERM)
                engine.wait(60)
            for staleness, row in rows.items():
                speed_up = rows[0]["wall"] / row["wall"]
                table.add_row(name, str(staleness), *(f"{row[k]:.2f}" for k in columns), f"{speed_up:.2f}x")
            synchronous, overlapped = projected(rows[0])
            projections.add_row(
                f"{name}, measured here (synchronous run)",
                f"{synchronous:.2f}",
                f"{overlapped:.2f}",
                f"{synchronous / overlapped:.2f}x",
            )
    for judge_apart, where in ((False, "the judge on the trainer's GPU"), (True, "the judge on a GPU of its own")):
        synchronous, overlapped = projected(H100_PROJECTED, judge_apart)
        projections.add_row(
            f"GPU: bench/README.md 8's H100 projection (not measured), {where}",
            f"{synchronous:.1f}",
            f"{overlapped:.1f}",
            f"{synchronous / overlapped:.2f}x",
        )
    console.print(table)
    console.print(projections)


if __name__ == "__main__":
    main()
