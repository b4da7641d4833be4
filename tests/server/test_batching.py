"""The micro-batcher: concurrent requests share model calls, and every request gets exactly its own results."""

from __future__ import annotations

import asyncio
import threading

import pytest

from redteam_grpo.server.batching import MicroBatcher


def _run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_calls_and_get_their_own_results_in_order():
    calls: list[list[int]] = []

    def double(items):
        calls.append(list(items))
        return [2 * x for x in items]

    async def main():
        batcher = MicroBatcher(double, max_batch=64, max_wait_s=0.05)
        await batcher.start()
        requests = [list(range(10 * i, 10 * i + 3)) for i in range(12)]
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        await batcher.stop()
        return requests, results, batcher

    requests, results, batcher = _run(main())
    assert results == [[2 * x for x in r] for r in requests]
    assert len(calls) < len(requests)  # batched: 12 requests in fewer model calls
    assert batcher.requests_served == 12 and batcher.batches_run == len(calls)
    assert all(len(c) <= 64 for c in calls)


def test_a_batch_never_exceeds_max_batch_and_an_oversized_request_runs_alone():
    calls: list[int] = []

    def identity(items):
        calls.append(len(items))
        return list(items)

    async def main():
        batcher = MicroBatcher(identity, max_batch=8, max_wait_s=0.05)
        await batcher.start()
        sizes = [3, 3, 3, 20, 3]
        out = await asyncio.gather(*(batcher.submit([f"{i}-{j}" for j in range(n)]) for i, n in enumerate(sizes)))
        await batcher.stop()
        return sizes, out

    sizes, out = _run(main())
    assert [len(o) for o in out] == sizes
    assert out[3] == [f"3-{j}" for j in range(20)]
    assert 20 in calls  # the oversized request alone, never split and never joined
    assert all(n <= 8 for n in calls if n != 20)


def test_an_error_in_the_model_call_reaches_every_request_of_the_batch_and_the_batcher_survives():
    fail = threading.Event()
    fail.set()

    def flaky(items):
        if fail.is_set():
            raise ValueError("model exploded")
        return items

    async def main():
        batcher = MicroBatcher(flaky, max_batch=16, max_wait_s=0.05)
        await batcher.start()
        outcomes = await asyncio.gather(batcher.submit([1]), batcher.submit([2]), return_exceptions=True)
        fail.clear()
        after = await batcher.submit([3])
        await batcher.stop()
        return outcomes, after

    outcomes, after = _run(main())
    assert all(isinstance(o, ValueError) and "model exploded" in str(o) for o in outcomes)
    assert after == [3]


def test_a_batch_function_that_loses_items_is_an_error_not_a_shifted_result():
    async def main():
        batcher = MicroBatcher(lambda items: items[:-1], max_batch=16, max_wait_s=0.0)
        await batcher.start()
        try:
            with pytest.raises(RuntimeError, match="returned 1 results for 2 items"):
                await batcher.submit([1, 2])
        finally:
            await batcher.stop()

    _run(main())
