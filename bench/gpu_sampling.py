"""Sampling, side by side in one run: completion tokens/s on a random-weight Qwen3 with Qwen3's vocabulary, the same
prompts and length, from

  hf                 the in-process sampler (`core/rollouts/sampling.py`: transformers `generate`, each token drawn and
  recorded) vllm direct        one plain completions request to the vLLM server (no token mask, no logprobs, no seed)
  + logprobs, + seed, + allowed ids, + logit bias
                     that request with one more of the settings our client needs, to show where the time goes
  vllm ours          the project's client (`server/vllm_client.py`: suppressed ids, processed logprobs, token ids,
                     seed, checks)

with a LoRA adapter loaded (the policy's, as in a run). Target: ours >= 0.8x vLLM called directly.

    python bench/gpu_sampling.py --shape small --device cpu --engine .vllm     # the CPU engine, started here
    python bench/gpu_sampling.py --model-dir /tmp/qwen3-4b-random --engine .vllm   # a GPU: Qwen3-4B, vllm build
    python bench/gpu_sampling.py --vllm-url http://127.0.0.1:8100 ...           # a server started elsewhere

`--engine FOLDER` starts `redteam-grpo serve-sampler --vllm FOLDER` on the model for the benchmark and stops it after.
A random model almost never draws an end-of-turn token, so every completion runs to --tokens.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(
    folder: Path, model: Path | str, dtype: str, log: Path, kv_cache_gib: float = 4, env=None, preexec_fn=None
) -> tuple[subprocess.Popen, str]:
    """serve-sampler on `model`, once it answers /health; `env` and `preexec_fn` for its process (a pinned core)."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "redteam_grpo.cli.main", "serve-sampler", "--vllm", str(folder)]
    command += [
        "--port",
        str(port),
        "--kv-cache-gib",
        str(kv_cache_gib),
        "--set",
        f"model.policy={model}",
        "--set",
        f"model.dtype={dtype}",
    ]
    proc = subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
        env=env,
        preexec_fn=preexec_fn,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine stopped: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"the engine did not answer in 10 minutes: see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="the random model's folder (built if absent)")
    parser.add_argument("--shape", choices=["4b", "small", "tiny"], default="4b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="sequences per generate call (HF)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16")
    parser.add_argument("--engine", type=Path, help="an engine environment (install-sampler) to start a server from")
    parser.add_argument("--vllm-url", help="a vLLM server already serving --model-dir (redteam-grpo serve-sampler)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    import httpx
    import qwen3_4b
    import torch
    from rich.console import Console
    from rich.table import Table

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import load_policy
    from redteam_grpo.core.models.roles import DEFAULT_ROLE
    from redteam_grpo.core.rollouts.sampling import sample_completions
    from redteam_grpo.server.vllm_client import PEFT_ADAPTER_FILE, VllmSampler, adapter_name

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu (with --shape small)")
    console = Console()
    shape = qwen3_4b.SHAPES[args.shape]
    folder = qwen3_4b.build(args.model_dir or Path(f"/tmp/qwen3-{args.shape}-random"), shape=args.shape)
    vocab = shape["vocab_size"]
    dtype = args.dtype or "bfloat16"
    policy = load_policy(ModelConfig(policy=str(folder), dtype=dtype), 1.0, torch.device(args.device), 0)
    policy.end_of_turn_ids = [vocab - 1]  # as good as never drawn: fixed length
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 1, (args.prompts, 64), generator=generator).tolist()
    rates: dict[str, float] = {}

    def rate(name: str, run) -> None:
        with console.status(f"{name} ..."):
            run()  # warm-up
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            tokens = run()
            rates[name] = tokens / (time.perf_counter() - started)

    rate(
        "hf",
        lambda: sum(
            len(c.completion_ids) for c in sample_completions(policy, prompts, args.group, args.tokens, args.batch, 0)
        ),
    )
    engine = None
    url = args.vllm_url
    if args.engine:
        with console.status("starting the engine ..."):
            engine, url = start_engine(args.engine, folder, dtype, folder.parent / f"{folder.name}-engine.log")
    try:
        if url:
            adapter_dir = folder.parent / f"{folder.name}-adapter"
            policy.model.save_pretrained(adapter_dir, selected_adapters=[DEFAULT_ROLE], save_embedding_layers=False)
            name = adapter_name("bench", 0, adapter_dir / PEFT_ADAPTER_FILE)
            client = VllmSampler(url)
            client.wait_ready()
            client.load_adapter(name, adapter_dir)
            suppressed = sorted(set(policy.distribution.suppressed_ids))
            allowed = [i for i in range(vocab) if i not in set(suppressed)]
            http = httpx.Client(base_url=url, timeout=3600)
            plain = {"model": name, "prompt": prompts, "n": args.group, "max_tokens": args.tokens, "temperature": 1.0}
            plain |= {"top_k": 0, "top_p": 1.0, "stop_token_ids": [vocab - 1]}
            variants = {
                "vllm direct": {},
                "+ logprobs": {"logprobs": 0, "return_token_ids": True},
                "+ seed": {"seed": 0},
                "+ allowed ids": {"allowed_token_ids": allowed},
                "+ logit bias": {"logit_bias": {str(i): -100 for i in suppressed}},
            }
            for label, extra in variants.items():

                def direct(extra=extra) -> int:
                    answer = http.post("/v1/completions", json=plain | extra).raise_for_status().json()
                    return answer["usage"]["completion_tokens"]

                rate(label, direct)

            def ours() -> int:
                drawn = client.sample(
                    name, prompts, args.group, args.tokens, 1.0, 0, policy.end_of_turn_ids, suppressed
                )
                return sum(len(c.completion_ids) for c in drawn)

            rate("vllm ours", ours)
    finally:
        if engine is not None:
            os.killpg(engine.pid, signal.SIGTERM)
            engine.wait(60)

    title = f"Qwen3 {args.shape} random, {dtype}, {args.device}, {args.prompts} prompts x {args.group} x {args.tokens}"
    table = Table(title=title)
    for column in ("sampler", "completion tokens / s", "ratio to hf", "ratio to vllm direct"):
        table.add_column(column, justify="right")
    for label, value in rates.items():
        direct_ratio = f"{value / rates['vllm direct']:.2f}x" if "vllm direct" in rates and label != "hf" else ""
        table.add_row(label, f"{value:,.0f}", f"{value / rates['hf']:.2f}x", direct_ratio)
    console.print(table)
    if "vllm ours" in rates:
        console.print(f"ours / vLLM direct: [bold]{rates['vllm ours'] / rates['vllm direct']:.2f}x[/] (target >= 0.8)")


if __name__ == "__main__":
    main()
