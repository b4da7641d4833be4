"""Memory of the sampler's bookkeeping, side by side in one run: peak resident memory a sampling call adds for

  stepwise           `core/rollouts/sampling.py`: one token id and one logprob per sequence and step, recorded as drawn
  scores + logits    `generate(output_scores=True, output_logits=True)`, the bookkeeping a drift check after
                     `generate` needs: every step's [batch, vocab] scores and logits (one tensor each step here,
                     where no logits processor makes the scores another tensor than the logits; two with one)

each in a fresh process, on a tiny random Qwen3 with Qwen3's vocabulary (151,936), so the model itself weighs little
and what grows is the bookkeeping. glibc's mmap threshold is fixed so freed blocks leave the resident set (see
tests/core/test_sampling_memory.py). Then the bound for a configuration, from its sampling.batch_size and
max_new_tokens.

    python bench/sampler_memory.py [--batch 16] [--tokens 96] [--config configs/qwen3-4b-instruct.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VOCAB = 151_936
KINDS = ("stepwise", "scores + logits")


def child(kind: str, batch: int, tokens: int) -> dict:
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import _wrap, load_tokenizer
    from redteam_grpo.core.rollouts.sampling import _left_pad, sample_completions

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj"])).eval()
    policy = _wrap(model, load_tokenizer(ModelConfig()), 1.0, torch.device("cpu"))
    policy.end_of_turn_ids = [VOCAB - 1]  # rarely drawn at random weights: every row runs to the limit
    prompts = [[1, 2, 3, 4]]
    sample_completions(policy, prompts, 2, 2, 2, seed=0)  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        if kind == "stepwise":
            sample_completions(policy, prompts, batch, tokens, batch, seed=0)
        else:
            ids, mask = _left_pad(prompts * batch, policy.pad_id)
            generation = GenerationConfig(
                do_sample=True,
                top_k=0,
                max_new_tokens=tokens,
                eos_token_id=policy.end_of_turn_ids,
                pad_token_id=policy.pad_id,
                output_scores=True,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out = policy.model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)
            assert len(out.scores) == tokens
    return {"added_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--config", default="configs/qwen3-4b-instruct.yaml", help="the configuration to bound")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.tokens)))
        return

    from rich.console import Console
    from rich.table import Table

    from redteam_grpo.core.config import load_config

    console = Console()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    measured = {}
    for kind in KINDS:
        command = [sys.executable, __file__, "--child", kind, "--batch", str(args.batch), "--tokens", str(args.tokens)]
        with console.status(f"{kind} ..."):
            result = subprocess.run(command, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{result.stderr[-4000:]}")
        measured[kind] = json.loads(result.stdout.strip().splitlines()[-1])["added_mib"]
    table = Table(title=f"peak memory a sampling call adds: batch {args.batch} x {args.tokens} tokens, vocab {VOCAB:,}")
    for column in ("", "MiB", "ratio to stepwise"):
        table.add_column(column, justify="right")
    for kind in KINDS:
        table.add_row(kind, f"{measured[kind]:.0f}", f"{measured[kind] / measured['stepwise']:.1f}x")
    console.print(table)

    cfg = load_config(Path(args.config), [])
    b, t = cfg.sampling.batch_size, cfg.sampling.max_new_tokens
    per_step_mib = b * VOCAB * 4 / 2**20  # one float32 [batch, vocab] tensor
    console.print(
        f"{args.config} (sampling.batch_size {b}, max_new_tokens {t}), vocab {VOCAB:,}:\n"
        f"  stepwise bookkeeping: {b * t * 12 / 2**10:.0f} KiB (an int64 id and a float32 logprob per token), plus "
        f"the current step's \\[batch, vocab] tensors, {per_step_mib:.0f} MiB each, a handful at a time\n"
        f"  scores + logits: {2 * t * per_step_mib / 2**10:.1f} GiB held until generate returns (one copy each)"
    )


if __name__ == "__main__":
    main()
