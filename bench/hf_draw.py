"""The in-process sampler's draw, side by side in one process: the earlier draw (torch.multinomial, then generate in
sampling mode drawing again over the one-hot) against the present one (the inverse CDF, generate greedy), on the same
random Qwen3 with Qwen3's 151,936-id vocabulary, the same prompts and seeds, alternating, best of --repeats each.

    python bench/hf_draw.py [--shape small] [--rows 64] [--tokens 16] [--threads 1] [--repeats 2]

The earlier draw is put back by patching `core/rollouts/sampling.py`'s `draw_tokens` and `generation_config` in this
process only. Completion tokens/s, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["small", "tiny"], default="small", help="small: hidden 512 x 8 layers")
    parser.add_argument("--rows", type=int, default=64, help="sequences per generate call")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per completion (every row runs to it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, help="where the random model is saved (default: a temporary folder)")
    args = parser.parse_args()

    import qwen3_4b
    import torch
    from rich.console import Console
    from rich.table import Table

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import load_policy
    from redteam_grpo.core.rollouts import sampling

    torch.set_num_threads(args.threads)
    folder = qwen3_4b.build(args.model_dir or Path(tempfile.mkdtemp()) / f"qwen3-{args.shape}-random", shape=args.shape)
    model = ModelConfig(policy=str(folder), dtype="bfloat16", system_prompt=None)
    policy = load_policy(model, 1.0, torch.device("cpu"), 0)
    policy.end_of_turn_ids = [qwen3_4b.SHAPES[args.shape]["vocab_size"] - 1]  # an id never drawn: rows run to the end
    prompts = [[100 + i, 200, 300, 400] for i in range(args.rows // 8)]

    present_draw, present_config = sampling.draw_tokens, sampling.generation_config

    def earlier_draw(logprobs_B_V, generator):
        return torch.multinomial(logprobs_B_V.exp(), 1, generator=generator)

    def earlier_config(policy, max_new_tokens):
        config = present_config(policy, max_new_tokens)
        config.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        return config

    kinds = {
        "earlier: multinomial, then generate draws again": (earlier_draw, earlier_config),
        "present: inverse CDF, generate greedy": (present_draw, present_config),
    }
    best = dict.fromkeys(kinds, 0.0)
    for repeat in range(args.repeats):
        for name, (draw, config) in kinds.items():
            sampling.draw_tokens, sampling.generation_config = draw, config
            started = time.perf_counter()
            done = sampling.sample_completions(policy, prompts, 8, args.tokens, args.rows, seed=repeat)
            tokens = sum(len(c.completion_ids) for c in done)
            best[name] = max(best[name], tokens / (time.perf_counter() - started))
    sampling.draw_tokens, sampling.generation_config = present_draw, present_config

    table = Table(
        title=f"Qwen3 {args.shape} random, bfloat16, {args.rows} rows x {args.tokens} tokens, {args.threads} thread(s)"
    )
    for column in ("draw", "completion tokens / s", "ratio"):
        table.add_column(column, justify="right")
    earlier = best[next(iter(kinds))]
    for name, rate in best.items():
        table.add_row(name, f"{rate:.1f}", f"{rate / earlier:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
