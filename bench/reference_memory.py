"""Memory of the KL reference, side by side in one run: peak resident memory a process adds for

  policy alone      a random-weight Qwen3 with its LoRA adapter, one forward of a scoring batch
  policy + ours     the same, plus the reference forward as this project does it: the adapter switched off
                    (`Policy.reference`), no second copy of the weights
  policy + a copy   the same, plus a reference as a second copy of the base model (what a trainer without
                    adapters must hold)

each in a fresh process, after imports. glibc's mmap threshold is fixed so that freed blocks leave the resident
set (tests/core/test_sampling_memory.py says why): what is measured is what is held.

    python bench/reference_memory.py [--hidden 1024] [--layers 12] [--batch 32] [--tokens 256]

Prints each peak and the ratios to the policy alone (target for ours: <= 1.2x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

KINDS = ("policy alone", "policy + ours", "policy + a copy")


def child(kind: str, hidden: int, layers: int, batch: int, tokens: int) -> dict:
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import _wrap, load_tokenizer
    from redteam_grpo.core.training.kl import policy_reference_logprobs

    def resident_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    tokenizer = load_tokenizer(ModelConfig())
    before = resident_mib()
    heads = hidden // 64
    config = Qwen3Config(
        vocab_size=32_000,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
    )
    torch.manual_seed(0)
    policy = _wrap(
        get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=16, target_modules=["q_proj", "v_proj"])).eval(),
        tokenizer,
        1.0,
        torch.device("cpu"),
    )
    prompts = [[5 + i % 100 for i in range(32)]] * batch
    completions = [[7 + i % 200 for i in range(tokens)]] * batch
    copy = Qwen3ForCausalLM(config).eval() if kind == "policy + a copy" else None
    with torch.no_grad():
        if kind == "policy + ours":
            policy_reference_logprobs(policy, prompts, completions)
        else:
            from redteam_grpo.core.training.kl import _sampled_logprobs

            _sampled_logprobs(policy, prompts, completions)
            if copy is not None:
                copy(input_ids=torch.tensor([p + c for p, c in zip(prompts, completions, strict=True)]))
    parameters = sum(p.numel() for p in policy.model.parameters())
    return {"added_mib": resident_mib() - before, "parameters": parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="sequences per forward (training.micro_batch_size)")
    parser.add_argument("--tokens", type=int, default=128, help="completion tokens per sequence")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.hidden, args.layers, args.batch, args.tokens)
    if args.child:
        print(json.dumps(child(args.child, *shape)))
        return

    from rich.console import Console
    from rich.table import Table

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    measured = {}
    console = Console()
    for kind in KINDS:
        with console.status(f"{kind} ..."):
            command = [sys.executable, __file__, "--child", kind, "--hidden", str(args.hidden)]
            command += ["--layers", str(args.layers), "--batch", str(args.batch), "--tokens", str(args.tokens)]
            result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{result.stderr[-4000:]}")
        measured[kind] = json.loads(result.stdout.strip().splitlines()[-1])
    millions = measured[KINDS[0]]["parameters"] / 1e6
    table = Table(
        title=f"peak memory added: random Qwen3 {millions:.0f} M parameters (hidden {args.hidden}, {args.layers} "
        f"layers), float32, forward of {args.batch} x {32 + args.tokens} tokens"
    )
    for column in ("", "MiB", "ratio to the policy alone"):
        table.add_column(column, justify="right")
    alone = measured[KINDS[0]]["added_mib"]
    for kind in KINDS:
        table.add_row(kind, f"{measured[kind]['added_mib']:.0f}", f"{measured[kind]['added_mib'] / alone:.2f}x")
    console.print(table)
    console.print("target: policy + ours <= 1.20x the policy alone")


if __name__ == "__main__":
    main()
