"""Sampling on a GPU, side by side in one run: completion tokens/s on a random-weight Qwen3-4B (bfloat16), the same
prompts and length, from

  hf            the in-process sampler (`core/sampling.py`: transformers `generate`, each token drawn and recorded)
  vllm direct   one plain completions request to a vLLM server (no token mask, no logprobs, no checks)
  vllm ours     the project's client (`server/vllm_client.py`: allowed ids, processed logprobs, token ids, checks)

with a LoRA adapter loaded (the policy's, as in a run). Target: ours >= 0.8x vLLM called directly.

    python bench/gpu_sampling.py --model-dir /tmp/qwen3-4b-random     # saves the random model there; HF only
    redteam-grpo serve-sampler --set model.policy=/tmp/qwen3-4b-random --vllm .vllm/bin/vllm   # another shell
    python bench/gpu_sampling.py --model-dir /tmp/qwen3-4b-random --vllm-url http://127.0.0.1:8100
    python bench/gpu_sampling.py --tiny --device cpu --model-dir /tmp/tiny --vllm-url URL   # its code, on a CPU

A random model almost never draws an end-of-turn token, so every completion runs to --tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="the random model's folder (built if absent)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=16, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="sequences per generate call (HF)")
    parser.add_argument("--vllm-url", help="a vLLM server serving --model-dir (redteam-grpo serve-sampler)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()

    import httpx
    import qwen3_4b
    import torch
    from rich.console import Console
    from rich.table import Table

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.policy import load_policy
    from redteam_grpo.core.roles import DEFAULT_ROLE
    from redteam_grpo.core.sampling import sample_completions
    from redteam_grpo.server.vllm_client import PEFT_ADAPTER_FILE, VllmSampler, adapter_name

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark is for a GPU (try --tiny --device cpu to run its code)")
    console = Console()
    folder = qwen3_4b.build(args.model_dir, tiny=args.tiny)
    vocab = (qwen3_4b.TINY if args.tiny else qwen3_4b.QWEN3_4B)["vocab_size"]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    policy = load_policy(ModelConfig(policy=str(folder), dtype=dtype), 1.0, torch.device(args.device), 0)
    policy.end_of_turn_ids = [vocab - 1]  # as good as never drawn: fixed length
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 1, (args.prompts, 64), generator=generator).tolist()
    rates: dict[str, float] = {}

    def rate(name: str, run) -> None:
        run()  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = run()
        rates[name] = tokens / (time.perf_counter() - started)

    with console.status("hf ..."):
        rate(
            "hf",
            lambda: sum(
                len(c.completion_ids)
                for c in sample_completions(policy, prompts, args.group, args.tokens, args.batch, seed=0)
            ),
        )
    if args.vllm_url:
        adapter_dir = folder.parent / f"{folder.name}-adapter"
        policy.model.save_pretrained(adapter_dir, selected_adapters=[DEFAULT_ROLE], save_embedding_layers=False)
        name = adapter_name("bench", 0, adapter_dir / PEFT_ADAPTER_FILE)
        client = VllmSampler(args.vllm_url)
        client.wait_ready()
        client.load_adapter(name, adapter_dir)
        allowed = [i for i in range(vocab) if i not in set(policy.distribution.suppressed_ids)]
        http = httpx.Client(base_url=args.vllm_url, timeout=3600)

        def direct() -> int:
            body = {"model": name, "prompt": prompts, "n": args.group, "max_tokens": args.tokens, "temperature": 1.0}
            answer = http.post("/v1/completions", json=body).raise_for_status().json()
            return answer["usage"]["completion_tokens"]

        def ours() -> int:
            drawn = client.sample(name, prompts, args.group, args.tokens, 1.0, 0, policy.end_of_turn_ids, allowed)
            return sum(len(c.completion_ids) for c in drawn)

        with console.status("vllm direct ..."):
            rate("vllm direct", direct)
        with console.status("vllm ours ..."):
            rate("vllm ours", ours)

    title = (
        f"{'tiny' if args.tiny else 'Qwen3-4B'} random, {dtype}, {args.prompts} prompts x {args.group} x {args.tokens}"
    )
    table = Table(title=title)
    for column in ("sampler", "completion tokens / s", "ratio to hf"):
        table.add_column(column, justify="right")
    for name, value in rates.items():
        table.add_row(name, f"{value:,.0f}", f"{value / rates['hf']:.2f}x")
    console.print(table)
    if "vllm ours" in rates:
        console.print(f"ours / vLLM direct: [bold]{rates['vllm ours'] / rates['vllm direct']:.2f}x[/] (target >= 0.8)")


if __name__ == "__main__":
    main()
