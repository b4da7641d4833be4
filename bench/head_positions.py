"""The LM head over every position against over the completion's positions only: one forward of a random model of
Qwen3-4B's width and vocabulary, side by side in one run.

    python bench/head_positions.py                                # 2 layers, 8 rows of 30 + 16 tokens, bfloat16
    python bench/head_positions.py --layers 36 --prompt 512 --completion 512

The trainer's forwards (the score stage's KL and entropy terms, the train step) compute the logits of every position,
prompt included, and keep the completion's (`core/models/policy.py: packed_logits`). Only the positions that predict
a completion token are needed: transformers' `logits_to_keep` applies the head to the last N positions alone. At
Qwen3-4B's width the head (151,936 x 2,560) is as large as 5 decoder layers, so on short completions after long
prompts most of a shallow model's forward is logits nobody reads. Prints both times, their ratio, and whether the
kept logits are bit-identical to those of the whole forward. One compute thread unless OMP_NUM_THREADS says
otherwise; random weights (no download).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # after the thread count is set

QWEN3_4B_WIDTH = {  # Qwen/Qwen3-4B's config.json but for its depth
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=30, help="prompt tokens per row")
    parser.add_argument("--completion", type=int, default=16, help="completion tokens per row")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="each side's time is the least of these")
    args = parser.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_4B_WIDTH, num_hidden_layers=args.layers)
    model = Qwen3ForCausalLM._from_config(config, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.randint(0, config.vocab_size, (args.rows, args.prompt + args.completion))
    keep = args.completion + 1  # the last prompt position predicts the first completion token

    def forward(logits_to_keep: int) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            started = time.perf_counter()
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=logits_to_keep).logits
            return time.perf_counter() - started, logits

    every, kept = [], []
    for _ in range(args.repeats):  # alternated, so that a change in the machine's load falls on both
        seconds, all_logits = forward(0)  # 0: every position
        every.append(seconds)
        seconds, kept_logits = forward(keep)
        kept.append(seconds)
    identical = torch.equal(all_logits[:, -keep:], kept_logits)
    print(
        f"{args.layers} layers of Qwen3-4B's width, {args.rows} rows of {args.prompt} + {args.completion} tokens, "
        f"{args.dtype}, {torch.get_num_threads()} thread(s)\n"
        f"head over every position:        {min(every):7.2f} s\n"
        f"head over the last {keep:>4} positions: {min(kept):7.2f} s   ratio {min(kept) / min(every):.2f}\n"
        f"kept logits bit-identical to the whole forward's: {identical}"
    )


if __name__ == "__main__":
    main()
