"""One of our iterations against one step of TRL's `GRPOTrainer`, side by side in one run, on the same work:

  the same random-weight Qwen3 (saved once, loaded by both), the same 4 prompts (chat template, no system turn),
  G 8 completions of 32 tokens at temperature 1 (TRL's forced to 32; ours stop early only on an end-of-turn
  token, rare at random weights), LoRA r16 on the attention and MLP projections, a KL
  coefficient of 0.1 to the base (TRL: in the loss; ours: in the reward), the embedded toxicity classifier as the
  only reward, one update per batch, float32 (TRL's default bf16 autocast off), one CPU thread each,

at three model sizes (hidden/layers 64/2, 256/4, 512/8 by default). TRL is timed per optimizer step (its step
generates, scores, runs the reference and trains); ours per iteration of the Prefect pipeline (five stages, Parquet,
a checkpoint) and of the same `core` functions in a plain loop (bench/orchestration.py), each from one step's start
to the next one's. The first step of each is left out (warm-up), and the last (it ends in the run's end: ours, a
Prefect flow run completing, ~0.6 s once a run; TRL's trainer, none measurable): what the run's end adds once is
printed apart.

    pip install -e ".[bench]"     # trl, only for this benchmark
    python bench/peer_trl.py [--sizes 64x2,256x4,512x8] [--steps 8] [--rounds 1]

Prints seconds per step and the ratio ours / TRL (target <= 1.0 where compute dominates). On a machine whose speed
drifts between runs by more than the gap measured (a shared 2-core VM: 10-25 % within minutes), `--rounds N` runs
each kind N times, interleaved, and prints the ratio of each round beside the mean over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "Tell me what you think about the people next door.",
    "Describe my coworker in one paragraph.",
    "Write a reply to an angry customer.",
    "What would you say to someone who cut in line?",
]
GROUP, TOKENS, RANK, BETA, LEARNING_RATE = 8, 32, 16, 0.1, 3e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(folder: Path, hidden: int, layers: int) -> None:
    """A random-weight Qwen3 of the given size with the embedded tokenizer (its chat template), saved to `folder`."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as transformers_logging

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    heads = max(2, hidden // 64)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformers_logging.disable_progress_bar()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def ours_overrides(folder: Path) -> list[str]:
    return [
        f"model.policy={folder}",
        "model.system_prompt=null",
        f"model.lora_rank={RANK}",
        f"model.lora_alpha={RANK}",
        "data.prompts_per_iteration=4",
        f"sampling.group_size={GROUP}",
        f"sampling.max_new_tokens={TOKENS}",
        f"reward.kl_weight={BETA}",
        "reward.repetition_weight=0",
        "reward.novelty_weight=0",
        f"training.learning_rate={LEARNING_RATE}",
    ]


def child_ours(kind: str, folder: Path, steps: int, prompt_file: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    import orchestration

    run = orchestration.child_pipeline if kind == "pipeline" else orchestration.child_plain
    overrides = [*ours_overrides(folder), f"data.source={prompt_file}"]
    result = run(steps, overrides)
    return {"step_seconds": result["iteration_seconds"], "run_end": result["run_end"], "phases": result.get("phases")}


def child_trl(folder: Path, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from redteam_grpo.core.config import RewardConfig
    from redteam_grpo.core.scoring.backend import build_local_scoring

    sys.path.insert(0, str(Path(__file__).parent))
    import orchestration

    scoring = build_local_scoring(RewardConfig(), torch.device("cpu"))

    def toxicity(completions, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [s.score for s in scoring.score(texts, None)]

    begins: list[float] = []
    spent: dict[str, list[float]] = {"generate": [], "reward": [], "generate and score": []}

    def timed(name, method):
        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter() - started)

        return wrapped

    GRPOTrainer._generate = timed("generate", GRPOTrainer._generate)
    GRPOTrainer._calculate_rewards = timed("reward", GRPOTrainer._calculate_rewards)
    GRPOTrainer._generate_and_score_completions = timed(
        "generate and score", GRPOTrainer._generate_and_score_completions
    )

    class StepClock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            begins.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS] * steps)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,  # TRL's default is bf16 autocast, on the CPU too: both sides compute in float32 here
            per_device_train_batch_size=len(PROMPTS) * GROUP,
            num_generations=GROUP,
            max_completion_length=TOKENS,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            beta=BETA,
            learning_rate=LEARNING_RATE,
            num_iterations=1,
            max_steps=steps,
            logging_steps=10_000,
            save_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
            generation_kwargs={"min_new_tokens": TOKENS},  # exactly TOKENS, as ours at random weights
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=toxicity,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, task_type="CAUSAL_LM"),
            callbacks=[StepClock()],
        )
        trainer.train()
        end = time.perf_counter()
    steps_s = orchestration.per_iteration(begins)  # as ours: step 0 and the last (it ends in the run's end) left out

    def mean_after_warmup(name: str) -> float:
        return sum(spent[name][1:]) / len(spent[name][1:])

    generate, scored = mean_after_warmup("generate"), mean_after_warmup("generate and score")
    phases = {"sample": generate, "score": scored - generate, "train": sum(steps_s) / len(steps_s) - scored}
    return {"step_seconds": steps_s, "run_end": orchestration.run_end(begins, end), "phases": phases}


def child_env(prefect_home: str) -> dict[str, str]:
    """A benchmark child's environment: a Prefect home of its own (its ephemeral API server), one compute thread."""
    env = {
        **os.environ,
        "PREFECT_HOME": prefect_home,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    env.pop("PREFECT_API_URL", None)
    return env


PHASES = ("sample", "score", "train")


def mean_phase(runs: list[dict], phase: str) -> float:
    return sum(r[phase] for r in runs) / len(runs)


def run_child(*args: str) -> dict:
    with tempfile.TemporaryDirectory() as home:
        command = [sys.executable, __file__, "--child", *args]
        result = subprocess.run(command, capture_output=True, text=True, env=child_env(home))
    if result.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64x2,256x4,512x8", help="hidden x layers, comma-separated")
    parser.add_argument(
        "--steps", type=int, default=8, help="steps per run (the first, warm-up, and the last, the run's end, left out)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each kind, interleaved (trl, pipeline, plain; the next round starts with the next kind): the "
        "table's seconds are the mean over every measured step of every round",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        import torch

        torch.set_num_threads(1)
        logging.disable(logging.WARNING)
        kind, folder = args.child[0], Path(args.child[1])
        if kind == "trl":
            print(json.dumps(child_trl(folder, args.steps)))
        else:
            print(json.dumps(child_ours(kind, folder, args.steps, Path(args.child[2]))))
        return

    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('this benchmark needs TRL: pip install -e ".[bench]"') from None
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    table = Table(title=f"s / step: 4 prompts x G {GROUP} x {TOKENS} tokens, LoRA r{RANK}, beta {BETA}, 1 thread")
    for column in ("hidden x layers", "TRL", "ours: pipeline", "ours: plain", "pipeline / TRL", "plain / TRL"):
        table.add_column(column, justify="right")
    phases = Table(title="where a step goes, s: sample | score (reward + reference forward) | train")
    for column in ("hidden x layers", "TRL", "ours: plain"):
        phases.add_column(column, justify="right")
    run_ends: dict[str, dict[str, float]] = {}
    per_round: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as work:
        prompt_file = Path(work) / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        for size in args.sizes.split(","):
            hidden, layers = (int(x) for x in size.split("x"))
            folder = Path(work) / f"qwen3-{hidden}x{layers}"
            build_model(folder, hidden, layers)
            kinds = ("trl", "pipeline", "plain")
            steps: dict[str, list[float]] = {k: [] for k in kinds}
            split: dict[str, list[dict]] = {k: [] for k in kinds}
            ends: dict[str, list[float]] = {k: [] for k in kinds}
            ratios: list[float] = []
            for round_number in range(args.rounds):
                # each round starts with another kind: a slow spell of the machine falls on each in turn
                order = kinds[round_number % 3 :] + kinds[: round_number % 3]
                means = {}
                for kind in order:
                    with console.status(f"hidden {hidden}, {layers} layers, round {round_number + 1}: {kind} ..."):
                        extra = [] if kind == "trl" else [str(prompt_file)]
                        result = run_child(kind, str(folder), *extra, "--steps", str(args.steps))
                    steps[kind] += result["step_seconds"]
                    means[kind] = sum(result["step_seconds"]) / len(result["step_seconds"])
                    split[kind].append(result.get("phases"))
                    ends[kind].append(result["run_end"])
                ratios.append(means["pipeline"] / means["trl"])
            seconds = {k: sum(v) / len(v) for k, v in steps.items()}
            phases.add_row(
                size,
                *(" | ".join(f"{mean_phase(split[k], p):.2f}" for p in PHASES) for k in ("trl", "plain")),
            )
            table.add_row(
                size,
                f"{seconds['trl']:.2f}",
                f"{seconds['pipeline']:.2f}",
                f"{seconds['plain']:.2f}",
                f"{seconds['pipeline'] / seconds['trl']:.2f}x",
                f"{seconds['plain'] / seconds['trl']:.2f}x",
            )
            if args.rounds > 1:
                per_round[size] = ratios
            run_ends[size] = {k: sum(v) / len(v) for k, v in ends.items()}
    console.print(table)
    console.print(phases)
    for size, ratios in per_round.items():
        ordered = sorted(ratios)
        console.print(
            f"{size}: pipeline / TRL in each round {', '.join(f'{r:.2f}x' for r in ratios)}; median "
            f"{statistics.median(ordered):.2f}x, spread {ordered[0]:.2f}-{ordered[-1]:.2f}x"
        )
    for size, end in run_ends.items():
        console.print(
            f"{size}: the run's end, once a run (left out above): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in end.items())
        )


if __name__ == "__main__":
    main()
