"""Reward-server throughput, side by side in one run: texts/s for

  single      one text per request, one request at a time (a naive client)
  concurrent  one text per request, many requests in flight (the server micro-batches them)
  batched     64 texts per request, one request at a time (what the trainer's client sends)
  in-process  the same scorer called directly, 64 texts per call (no HTTP)

    python bench/reward_server.py [--texts 512] [--scorer embedded:tiny-toxicity] [--concurrency 32]

The server is `redteam-grpo serve-reward` in its own process on a free loopback port, as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def texts_for(n: int, seed: int = 0) -> list[str]:
    from redteam_grpo.embedded import ToyGrammar, load_corpus

    rng, grammar = random.Random(seed), ToyGrammar(load_corpus())
    return [grammar.response(rng, marker_prob=0.1) for _ in range(n)]


def bench_single(url: str, texts: list[str]) -> float:
    with httpx.Client(base_url=url, timeout=60) as client:
        started = time.perf_counter()
        for text in texts:
            client.post("/score", json={"texts": [text]}).raise_for_status()
        return len(texts) / (time.perf_counter() - started)


def bench_batched(url: str, texts: list[str], per_request: int = 64) -> float:
    with httpx.Client(base_url=url, timeout=60) as client:
        started = time.perf_counter()
        for i in range(0, len(texts), per_request):
            client.post("/score", json={"texts": texts[i : i + per_request]}).raise_for_status()
        return len(texts) / (time.perf_counter() - started)


def bench_concurrent(url: str, texts: list[str], concurrency: int) -> float:
    async def main() -> float:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def one(text: str) -> None:
                async with gate:
                    (await client.post("/score", json={"texts": [text]})).raise_for_status()

            started = time.perf_counter()
            await asyncio.gather(*(one(t) for t in texts))
            return len(texts) / (time.perf_counter() - started)

    return asyncio.run(main())


def bench_in_process(scorer: str, texts: list[str]) -> float:
    import torch

    from redteam_grpo.core.config import RewardConfig
    from redteam_grpo.core.scoring.backend import build_local_scoring

    scoring = build_local_scoring(RewardConfig(scorer=scorer, batch_size=64), torch.device("cpu"))
    scoring.score(texts[:64], [""] * 64)  # warm-up
    started = time.perf_counter()
    for i in range(0, len(texts), 64):
        chunk = texts[i : i + 64]
        scoring.score(chunk, [""] * len(chunk))
    return len(texts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--scorer", default="embedded:tiny-toxicity")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()

    texts = texts_for(args.texts)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "redteam_grpo.cli.main",
            "serve-reward",
            "--scorer",
            args.scorer,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("the reward server did not become ready")
            time.sleep(0.2)
        bench_batched(url, texts[:128])  # warm-up: first calls allocate
        results = {
            "single": bench_single(url, texts),
            "concurrent": bench_concurrent(url, texts, args.concurrency),
            "batched": bench_batched(url, texts),
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    results["in-process"] = bench_in_process(args.scorer, texts)

    base = results["single"]
    print(f"scorer {args.scorer}, {len(texts)} texts, {os.cpu_count()} CPUs, concurrency {args.concurrency}")
    print(f"{'mode':<12}{'texts/s':>10}{'x single':>10}")
    for mode, rate in results.items():
        print(f"{mode:<12}{rate:>10.1f}{rate / base:>10.1f}")
    verdict = "meets" if results["batched"] / base >= 10 else "MISSES"
    print(f"batched / single = {results['batched'] / base:.1f} ({verdict} the >= 10x target)")


if __name__ == "__main__":
    main()
