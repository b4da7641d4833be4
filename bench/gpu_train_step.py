"""Train step on a GPU, side by side with its anchors: training tokens/s and model-FLOPs utilisation (MFU) of one
LoRA update (`core/training/train.py: policy_gradient_step`, the project's own) on a random-weight Qwen3-4B in bfloat16,
and end-to-end tokens/s of whole iterations (sample, score, update: bench/orchestration.py's plain loop) on the same
model.

    python bench/gpu_train_step.py [--batch 64] [--prompt-tokens 128] [--completion-tokens 256] [--peak-tflops 989]
    python bench/gpu_train_step.py --tiny --device cpu      # the same code on a CPU, to try it

FLOPs per trained token: 6N counts a full fine-tune's forward (2N) and backward (4N); a LoRA update skips the base's
weight gradients (2N), so it does 4N plus the adapters' and attention's share; MFU is printed with both counts
(N: the base's parameters). Anchors (reported elsewhere, not measured here): prime-rl's Qwen3-4B LoRA trainer about
22 % MFU on one H100; NeMo RL's 8B GRPO about 1,580 end-to-end tokens/s/GPU. Targets: >= 40 % MFU, >= 5,000
end-to-end tokens/s/GPU. Peak: 989 TFLOP/s, an H100 SXM's dense bfloat16.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def figures_table(title: str):
    """A table of figures beside their targets or anchors."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("", "value", "target / anchor"):
        table.add_column(column, justify="right")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="sequences per update")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=256)
    # the shipped Qwen3-4B config's: 16,384 without checkpointing ran out of an H200's 140 GiB (activations)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4, help="timed updates after one warm-up")
    parser.add_argument("--iterations", type=int, default=3, help="end-to-end iterations (the first is warm-up)")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same architecture")
    parser.add_argument("--model-dir", type=Path, help="where the random model is saved (default: a temporary folder)")
    args = parser.parse_args()

    import orchestration
    import qwen3_4b
    import torch
    from rich.console import Console

    from redteam_grpo.core.config import ModelConfig, TrainingConfig
    from redteam_grpo.core.models.policy import load_policy
    from redteam_grpo.core.training.train import TrainBatch, make_optimizer, policy_gradient_step

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark is for a GPU (try --tiny --device cpu to run its code)")
    console = Console()
    folder = qwen3_4b.build(args.model_dir or Path(tempfile.mkdtemp()) / "qwen3-4b-random", tiny=args.tiny)
    shape = qwen3_4b.TINY if args.tiny else qwen3_4b.QWEN3_4B
    n_params = qwen3_4b.parameters(shape)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_cfg = ModelConfig(policy=str(folder), dtype=dtype, system_prompt=None)
    policy = load_policy(model_cfg, 1.0, torch.device(args.device), 0)
    cfg = TrainingConfig(
        learning_rate=1e-5,
        micro_batch_size=args.batch,
        micro_batch_tokens=args.micro_batch_tokens,
        gradient_checkpointing=args.gradient_checkpointing,
        first_update_kl_tolerance=1e9,  # random weights and made-up sampling logprobs: the update is timed, not checked
    )
    optimizer = make_optimizer(policy, cfg)
    generator = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    prompts = torch.randint(10, vocab, (args.batch, args.prompt_tokens), generator=generator).tolist()
    completions = torch.randint(10, vocab, (args.batch, args.completion_tokens), generator=generator).tolist()
    batch = TrainBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        sample_logprobs=[[-5.0] * args.completion_tokens] * args.batch,
        advantages=[(-1.0) ** i for i in range(args.batch)],
        group_ids=[str(i // 8) for i in range(args.batch)],
        max_new_tokens=args.completion_tokens,
    )

    def synchronize() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    with console.status("update: warm-up ..."):
        policy_gradient_step(policy, optimizer, batch, cfg)
        synchronize()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with console.status(f"update: {args.steps} timed steps ..."):
        for _ in range(args.steps):
            policy_gradient_step(policy, optimizer, batch, cfg)
        synchronize()
    step_s = (time.perf_counter() - started) / args.steps
    trained = args.batch * (args.prompt_tokens + args.completion_tokens)  # every position runs forward and backward
    tokens_s = trained / step_s
    peak = args.peak_tflops * 1e12
    memory = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    del policy, optimizer
    if args.device == "cuda":
        torch.cuda.empty_cache()

    title = f"{'tiny' if args.tiny else 'Qwen3-4B'} (N = {n_params / 1e9:.2f} B), {dtype}, LoRA r16, {args.device}"
    table = figures_table(title)
    shape_text = f"{args.batch} x {args.prompt_tokens + args.completion_tokens}, {args.micro_batch_tokens} per forward"
    table.add_row("update: s / step", f"{step_s:.2f}", shape_text)
    table.add_row("update: tokens / s", f"{tokens_s:,.0f}", "")
    table.add_row("MFU, 6N per token", f"{100 * 6 * n_params * tokens_s / peak:.1f} %", ">= 40 % (prime-rl: ~22 %)")
    table.add_row("MFU, 4N per token (frozen base)", f"{100 * 4 * n_params * tokens_s / peak:.1f} %", "")
    table.add_row("peak GPU memory, GiB", f"{memory:.1f}", "")
    console.print(table)  # before the end-to-end part, which loads the model again and may fail on its own

    with console.status(f"end to end: {args.iterations} iterations ..."):
        overrides = [
            f"model.policy={folder}",
            f"model.dtype={dtype}",
            "model.system_prompt=null",
            f"run.device={args.device}",
            "data.prompts_per_iteration=8",
            "sampling.group_size=8",
            f"sampling.max_new_tokens={args.completion_tokens}",
            f"training.micro_batch_tokens={args.micro_batch_tokens}",
        ]
        e2e = orchestration.child_plain(args.iterations, overrides)
    e2e_s = sum(e2e["iteration_seconds"]) / len(e2e["iteration_seconds"])
    e2e_tokens = 64 * args.completion_tokens  # an upper bound: completions that stop early have fewer

    table = figures_table(f"end to end: {title}")
    table.add_row("end to end: s / iteration", f"{e2e_s:.2f}", "8 prompts x G 8")
    table.add_row("end to end: completion tokens / s", f"<= {e2e_tokens / e2e_s:,.0f}", ">= 5,000 (NeMo RL 8B: ~1,580)")
    table.add_row("end to end phases, s", json.dumps({k: round(v, 2) for k, v in e2e["phases"].items()}), "")
    console.print(table)


if __name__ == "__main__":
    main()
