"""Reward-server throughput, side by side in one run: texts/s for

  single      one text per request, one request at a time (a naive client)
  concurrent  one text per request, many requests in flight (the server micro-batches them)
  batched     64 texts per request, one request at a time (what the trainer's client sends)
  in-process  the same scorer called directly, 64 texts per call (no HTTP)

and, under load, --clients clients each sending --requests requests of 1 to 16 texts back to back (default 8 x 500):
every status counted (the target: no 5xx), the latency percentiles, and the server's memory before, after and at
its peak (VmHWM), so a leak or a queue that grows shows.

    python bench/reward_server.py [--texts 512] [--scorer embedded:tiny-toxicity] [--concurrency 32]
                                  [--clients 8] [--requests 500]

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
from pathlib import Path

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


def _memory_mb(pid: int) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and at its peak (VmHWM), in MB (Linux /proc)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def bench_load(url: str, texts: list[str], clients: int, requests: int) -> dict[str, float]:
    """`clients` clients at once, each `requests` requests back to back; statuses and latencies."""

    async def client_run(seed: int, latencies: list[float], statuses: dict[int, int]) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for _ in range(requests):
                batch = rng.sample(texts, rng.randint(1, 16))
                started = time.perf_counter()
                try:
                    status = (await client.post("/score", json={"texts": batch})).status_code
                except httpx.TransportError:
                    status = 0  # no answer at all
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1

    async def main() -> tuple[list[float], dict[int, int], float]:
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        started = time.perf_counter()
        await asyncio.gather(*(client_run(seed, latencies, statuses) for seed in range(clients)))
        return latencies, statuses, time.perf_counter() - started

    latencies, statuses, seconds = asyncio.run(main())
    latencies.sort()

    def percentile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "requests": len(latencies),
        "ok": statuses.get(200, 0),
        "5xx": sum(n for code, n in statuses.items() if code >= 500),
        "other": sum(n for code, n in statuses.items() if code != 200 and code < 500),
        "p50_ms": percentile(0.50),
        "p99_ms": percentile(0.99),
        "max_ms": latencies[-1] * 1000,
        "requests_per_s": len(latencies) / seconds,
    }


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
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=500)
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
        memory_before = _memory_mb(server.pid)
        load = bench_load(url, texts, args.clients, args.requests)
        memory_after = _memory_mb(server.pid)
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
    print(
        f"\nload: {args.clients} clients x {args.requests} requests of 1-16 texts: {load['requests']} requests, "
        f"{load['ok']} ok, {load['5xx']} 5xx, {load['other']} other; {load['requests_per_s']:.0f} requests/s"
    )
    print(f"latency ms: p50 {load['p50_ms']:.1f}, p99 {load['p99_ms']:.1f}, max {load['max_ms']:.1f}")
    print(
        f"server memory MB: {memory_before['VmRSS']:.0f} before, {memory_after['VmRSS']:.0f} after "
        f"(x{memory_after['VmRSS'] / memory_before['VmRSS']:.2f}), peak {memory_after['VmHWM']:.0f}"
    )
    print(f"5xx under load: {load['5xx']} ({'meets' if load['5xx'] == 0 else 'MISSES'} the zero target)")


if __name__ == "__main__":
    main()
