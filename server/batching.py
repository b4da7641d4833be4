"""Dynamic micro-batching: texts of concurrent requests share one model call.

A request's items wait at most `max_wait_s` for company; a batch closes as soon as it holds `max_batch`
items. The model runs in one worker thread, so the event loop keeps accepting requests while it computes
and calls never overlap on the model. A request is never split: a request of more than `max_batch` items
makes a batch of its own (the scorer slices it into forward passes itself). The items waiting for (or in) a model
call are bounded by `max_queued`: a request that would go beyond is refused (`QueueFull`) rather than held in
memory for ever while the model falls behind; a request alone in the queue is always taken, whatever its size.

Written here because no maintained library does this for a plain asyncio service without a framework of its
own (Ray Serve's `@serve.batch` needs Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


class QueueFull(RuntimeError):
    """The batcher holds as many items as it may; the message says how many."""


@dataclass
class _Pending:
    items: Sequence[Any]
    future: asyncio.Future


class MicroBatcher:
    def __init__(
        self,
        run_batch: Callable[[list[Any]], list[Any]],
        max_batch: int,
        max_wait_s: float,
        max_queued: int | None = None,
    ) -> None:
        if max_batch < 1 or max_wait_s < 0 or (max_queued is not None and max_queued < 1):
            raise ValueError("max_batch must be >= 1, max_wait_s >= 0 and max_queued >= 1 (or None: unbounded)")
        self.run_batch, self.max_batch, self.max_wait_s = run_batch, max_batch, max_wait_s
        self.max_queued = max_queued
        self.queued = 0  # items submitted and not yet answered: waiting, carried over or in the model call
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None
        self._carry: _Pending | None = None  # did not fit the last batch: first in the next one
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer")
        self.batches_run = 0  # for tests and /ready: how many model calls served how many requests
        self.requests_served = 0

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._loop(), name="micro-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, items: Sequence[Any]) -> list[Any]:
        """The results for `items`, in order, computed together with whatever else is queued."""
        if self._queue is None:
            raise RuntimeError("MicroBatcher.start() was not awaited")
        if self.max_queued is not None and self.queued and self.queued + len(items) > self.max_queued:
            raise QueueFull(
                f"{self.queued} texts are waiting for the model and this request brings {len(items)}; the limit is "
                f"{self.max_queued} (--max-queued-texts)"
            )
        future = asyncio.get_running_loop().create_future()
        self.queued += len(items)
        try:
            await self._queue.put(_Pending(items, future))
            return await future
        finally:  # answered, failed, or its client hung up (cancelled): no longer held
            self.queued -= len(items)

    async def _collect(self) -> list[_Pending]:
        assert self._queue is not None
        first, self._carry = self._carry, None
        batch = [first if first is not None else await self._queue.get()]
        size = len(batch[0].items)
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while size < self.max_batch:
            if not self._queue.empty():
                nxt = self._queue.get_nowait()
            else:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            if size + len(nxt.items) > self.max_batch:
                self._carry = nxt
                break
            batch.append(nxt)
            size += len(nxt.items)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            live = [p for p in batch if not p.future.cancelled()]  # a client that hung up
            if not live:
                continue
            flat = [item for p in live for item in p.items]
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, flat)
                if len(results) != len(flat):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(flat)} items")
            except Exception as exc:  # every request of the batch gets the error
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            self.batches_run += 1
            self.requests_served += len(live)
            start = 0
            for p in live:
                if not p.future.done():
                    p.future.set_result(results[start : start + len(p.items)])
                start += len(p.items)
