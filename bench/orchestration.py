"""Orchestration cost, side by side in one run: the same GRPO iterations

  pipeline  as Prefect stages writing Parquet (`attack_run`: one iteration run per iteration, a nested task run
            or, with Ray, a subflow run; five task runs, a manifest, a checkpoint per iteration), and
  plain     the same `core` functions called in a plain loop, weights in memory, nothing written,

each in a fresh process (same start: imports, model load), on the embedded default config unless --set says
otherwise. Both are timed per iteration, from the start of one iteration to the start of the next, leaving out
iteration 0 (kernel warm-up) and the last (it ends in the run's end, printed apart: a cost once a run, not an
iteration's). For the pipeline the time is split, exclusively, into the stages' compute, Parquet
writes and reads, the manifest (records and checksums), the checkpoint, artifacts, and what is left: Prefect's
flow-run and task-run overhead.

    python bench/orchestration.py [--iterations 6] [--set sampling.max_new_tokens=64 ...]

Prints the ratio pipeline / plain (target <= 1.10 on the default config) and the share of Parquet I/O in an
iteration (target < 2 %). With 40 iterations or more, also the cost per iteration against the run's length: the
median seconds per iteration of iterations 1-10 and of the last ten, in both runs (what the run directory records
must not make a long run's iterations slower: target <= 1.05 for the pipeline, beside the plain loop's own drift).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

CATEGORIES = (
    "compute",
    "parquet write",
    "parquet read",
    "manifest",
    "checkpoint",
    "artifacts",
    "iteration run",
    "task runs, logs",
)


class ExclusiveClock:
    """Seconds per category, exclusive: time inside a nested category counts for it only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._stack:
            outer, since = self._stack[-1]
            self.seconds[outer] += now - since
        self._stack.append((name, now))
        try:
            yield
        finally:
            name, since = self._stack.pop()
            now = time.perf_counter()
            self.seconds[name] += now - since
            if self._stack:
                self._stack[-1] = (self._stack[-1][0], now)

    def wrap(self, name: str, function: Callable) -> Callable:
        """`function` timed under `name` when the main thread calls it: the critical path. Calls from other threads
        (shard tasks on a thread pool) run untimed and leave the main thread's categories alone."""

        def wrapped(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return function(*args, **kwargs)
            with self.category(name):
                return function(*args, **kwargs)

        wrapped.__wrapped__ = function
        return wrapped


def per_iteration(starts: list[float]) -> list[float]:
    """Durations from each iteration's start to the next one's, iteration 0 (warm-up) and the last left out: the
    last one ends in the run's end (the pipeline's: a Prefect flow run completing, ~0.6 s once a run, measured beside
    ~1.7 s iterations at bench/peer_trl.py's 256x4), which is no iteration's cost; `run_end` reports it."""
    if len(starts) < 3:
        raise SystemExit("measure at least 3 iterations: the first (warm-up) and the last (the run's end) are left out")
    return [starts[i + 1] - starts[i] for i in range(1, len(starts) - 1)]


def run_end(starts: list[float], end: float) -> float:
    """The last iteration with the run's end after it, less the mean iteration: what the run's end adds once."""
    steps = per_iteration(starts)
    return end - starts[-1] - sum(steps) / len(steps)


def bench_run(iterations: int, runs_dir: str) -> list[str]:
    """The overrides of a benchmark's run: `iterations` of them, every one run (no early stop, as in the plain loop),
    as RUNS_DIR/bench."""
    return [
        f"run.iterations={iterations}",
        f"run.runs_dir={runs_dir}",
        "run.run_id=bench",
        "run.early_stop_reward=null",
        "run.early_stop_repetition=null",
    ]


def child_pipeline(iterations: int, overrides: list[str]) -> dict:
    from redteam_grpo.flows import attack, iteration, runner
    from redteam_grpo.storage import rundir
    from redteam_grpo.tasks import advantage, artifacts, checkpoint, common, judge, sample, score, train_step

    clock = ExclusiveClock()
    starts: list[float] = []
    snapshots: list[dict[str, float]] = []

    rundir.RunDir.read = clock.wrap("parquet read", rundir.RunDir.read)
    rundir.RunDir.write = clock.wrap("parquet write", rundir.RunDir.write)
    rundir.RunDir.record_done = clock.wrap("manifest", rundir.RunDir.record_done)

    def timed_stage(run, stage, iteration, compute, also_written=()):
        return common.run_table_stage(run, stage, iteration, clock.wrap("compute", compute), also_written)

    for module in (sample, score, advantage, train_step):
        module.run_table_stage = timed_stage
    # the sharded stages' compute, one task per shard
    for shard_task in (sample.sample_shard, judge.judge_shard, score.score_shard):
        shard_task.fn = clock.wrap("compute", shard_task.fn)
    iteration.checkpoint_stage.fn = clock.wrap("checkpoint", checkpoint.checkpoint_stage.fn)
    # what the iteration waits for: handing its artifacts over (they are published beside the run, untimed)
    iteration.publish_iteration_later = clock.wrap("artifacts", artifacts.publish_iteration_later)
    iteration_body = iteration.run_iteration

    def marked_iteration(run_dir, run_id, iteration):
        starts.append(time.perf_counter())
        snapshots.append(dict(clock.seconds))
        # inside the iteration's run: what no other category claims is Prefect's task runs, logging and the loop
        with clock.category("task runs, logs"):
            return iteration_body(run_dir, run_id, iteration)

    iteration.iteration_flow.fn = iteration.iteration_task.fn = marked_iteration
    runner_for = runner.iteration_runner
    # around the iteration's call: creating its task run (or subflow run), its states and its end, less the body
    runner.iteration_runner = lambda runtime: clock.wrap("iteration run", runner_for(runtime))
    with tempfile.TemporaryDirectory() as runs:
        attack.attack_run(overrides=[*overrides, *bench_run(iterations, runs)])
        end = time.perf_counter()
    # category seconds from the start of iteration 1 to the start of the last (per_iteration's), per iteration
    measured = iterations - 2
    after_warmup = {c: (snapshots[-1].get(c, 0.0) - snapshots[1].get(c, 0.0)) / measured for c in CATEGORIES}
    return {"iteration_seconds": per_iteration(starts), "run_end": run_end(starts, end), "categories": after_warmup}


def child_plain(iterations: int, overrides: list[str]) -> dict:
    import torch

    from redteam_grpo.core.config import load_config
    from redteam_grpo.core.data.sources import load_prompts, prompts_for_iteration
    from redteam_grpo.core.models.chat import format_prompt_ids
    from redteam_grpo.core.models.policy import load_policy, resolve_device
    from redteam_grpo.core.rollouts.sampling import sample_completions
    from redteam_grpo.core.scoring.backend import build_local_scoring
    from redteam_grpo.core.scoring.novelty import novelty_scores
    from redteam_grpo.core.seeds import derive_seed
    from redteam_grpo.core.training.advantages import group_advantages
    from redteam_grpo.core.training.rewards import RewardTerms, composite_reward, repetition_ratios
    from redteam_grpo.core.training.train import TrainBatch, make_optimizer, policy_gradient_step
    from redteam_grpo.tasks.score import policy_terms

    cfg = load_config(None, [*overrides, f"run.iterations={iterations}"])
    device = resolve_device(cfg.run.device)
    policy = load_policy(cfg.model, cfg.sampling.temperature, device, cfg.run.seed)
    optimizer = make_optimizer(policy, cfg.training)
    scoring = build_local_scoring(cfg.reward, device)
    prompts = load_prompts(cfg.data)
    r, G = cfg.reward, cfg.sampling.group_size
    memory: list[torch.Tensor] = []
    starts: list[float] = []
    phases: dict[str, list[float]] = {"sample": [], "score": [], "train": []}
    for iteration in range(iterations):
        starts.append(time.perf_counter())
        chosen = prompts_for_iteration(
            prompts, iteration, cfg.data.prompts_per_iteration, cfg.run.seed, cfg.data.shuffle
        )
        ids = [format_prompt_ids(policy.tokenizer, p.text, cfg.model.system_prompt) for p in chosen]
        seed = derive_seed(cfg.run.seed, "sample", iteration)
        completions = sample_completions(policy, ids, G, cfg.sampling.max_new_tokens, cfg.sampling.batch_size, seed)
        sampled_at = time.perf_counter()
        phases["sample"].append(sampled_at - starts[-1])
        completion_ids = [c.completion_ids for c in completions]
        prompt_ids = [ids[c.prompt_index] for c in completions]
        texts = policy.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        scored = scoring.score(texts, [chosen[c.prompt_index].text for c in completions])
        repetition = repetition_ratios(completion_ids, r.repetition_ngram)
        novelty = [None] * len(texts)
        if r.novelty_weight:
            embedded = scoring.embed(texts)
            past = torch.cat(memory[-r.novelty_memory_iterations :])[-r.novelty_memory_size :] if memory else None
            novelty = list(novelty_scores(embedded, past))
            memory.append(embedded)
        terms = policy_terms(policy, prompt_ids, completion_ids, cfg.training.micro_batch_size)
        reward = [
            composite_reward(RewardTerms(s.score, rep, k, nov, bool(s.refusal), ent), r.weights)
            for s, rep, k, nov, ent in zip(scored, repetition, terms.kl, novelty, terms.entropy, strict=True)
        ]
        scored_at = time.perf_counter()
        phases["score"].append(scored_at - sampled_at)
        rewards_P_G = torch.tensor(reward, dtype=torch.float64).view(len(chosen), G)
        advantages_P_G, _ = group_advantages(
            rewards_P_G, cfg.training.scale_by_group_std, cfg.training.batch_zscore, cfg.training.std_floor
        )
        batch = TrainBatch(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            sample_logprobs=[c.sample_logprobs for c in completions],
            advantages=advantages_P_G.flatten().tolist(),
            group_ids=[str(c.prompt_index) for c in completions],
            max_new_tokens=cfg.sampling.max_new_tokens,
        )
        policy_gradient_step(policy, optimizer, batch, cfg.training)
        phases["train"].append(time.perf_counter() - scored_at)
    # phases of iterations 1.. (0 is warm-up): sampling; scoring with the KL's forward; advantages and the update
    return {
        "iteration_seconds": per_iteration(starts),
        "run_end": run_end(starts, time.perf_counter()),
        "phases": {k: sum(v[1:]) / len(v[1:]) for k, v in phases.items()},
    }


def run_child(kind: str, iterations: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
        # a fresh PREFECT_HOME: the ephemeral API creates its database, ~20 s on a busy 2-core machine (cli/main.py)
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
        env.pop("PREFECT_API_URL", None)
        command = [sys.executable, __file__, "--child", kind, "--iterations", str(iterations)]
        for override in overrides:
            command += ["--set", override]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6, help="iterations per run (iteration 0 is warm-up)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    parser.add_argument("--child", choices=["pipeline", "plain"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iterations < 2:
        parser.error("--iterations must be at least 2: iteration 0 is left out as warm-up")
    if args.child:
        import logging

        logging.disable(logging.WARNING)
        run = child_pipeline if args.child == "pipeline" else child_plain
        print(json.dumps(run(args.iterations, args.overrides)))
        return

    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with console.status("plain loop ..."):
        plain = run_child("plain", args.iterations, args.overrides)
    with console.status("Prefect pipeline ..."):
        pipeline = run_child("pipeline", args.iterations, args.overrides)
    plain_s, pipeline_s = mean(plain["iteration_seconds"]), mean(pipeline["iteration_seconds"])

    table = Table(
        title=f"s / iteration, mean of iterations 1..{args.iterations - 2} ({torch.get_num_threads()} threads)"
    )
    table.add_column("")
    table.add_column("seconds", justify="right")
    table.add_column("share of the pipeline", justify="right")
    table.add_row("plain loop", f"{plain_s:.3f}", "")
    table.add_row("Prefect pipeline", f"{pipeline_s:.3f}", "100 %")
    categories = pipeline["categories"]
    for name in CATEGORIES:
        table.add_row(f"  {name}", f"{categories[name]:.3f}", f"{100 * categories[name] / pipeline_s:.1f} %")
    rest = pipeline_s - sum(categories.values())
    table.add_row("  the parent flow's loop, the rest", f"{rest:.3f}", f"{100 * rest / pipeline_s:.1f} %")
    console.print(table)
    parquet = categories["parquet write"] + categories["parquet read"]
    console.print(f"pipeline / plain: [bold]{pipeline_s / plain_s:.2f}x[/] (target <= 1.10)")
    console.print(f"Parquet I/O share of an iteration: [bold]{100 * parquet / pipeline_s:.2f} %[/] (target < 2 %)")
    if args.iterations >= 40:
        n = args.iterations

        def drift(seconds: list[float]) -> tuple[float, float]:  # iterations 1-10 and n-11..n-2 (per_iteration's)
            return statistics.median(seconds[:10]), statistics.median(seconds[-10:])

        for name, run in (("plain loop", plain), ("Prefect pipeline", pipeline)):
            early, late = drift(run["iteration_seconds"])
            console.print(
                f"{name}: median s / iteration {early:.3f} at iterations 1-10, {late:.3f} at {n - 11}-{n - 2}: "
                f"[bold]{late / early:.2f}x[/]"
            )
    ends = f"plain loop {plain['run_end']:.2f} s, pipeline {pipeline['run_end']:.2f} s"
    console.print(f"the run's end, once a run (left out above): {ends}")
    console.print(f"overrides: {' '.join(args.overrides) or '(embedded defaults)'}")


if __name__ == "__main__":
    main()
