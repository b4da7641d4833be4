"""The one retry loop of the project's HTTP clients (the reward server's, `server/client.py`, and the vLLM sampler's,
`server/vllm_client.py`): what waiting can fix is tried again with exponential backoff, anything else is the
caller's to report.

Retried: connection errors, timeouts, a connection closed before the answer, and HTTP 502/503/504 (a proxy without
its server, a server still loading or restarting). Every other answer, 4xx and 500 included, is returned at once: a
500 is a server failing on this very request, which the same request would meet again.

Written here (a dozen lines) rather than taken from a library: httpx's transport retries cover connection errors
only, and tenacity, which would cover the rest, is not a dependency of this project or of Prefect.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

MAX_BACKOFF_S = 30.0
# What a later attempt can get past: the server or a proxy was unreachable, slow, restarting or loading.
RETRIED_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
RETRIED_STATUS = frozenset({502, 503, 504})


class RetriesExhausted(Exception):
    """Every attempt met a retried error or status; `last` says what the last one met."""

    def __init__(self, last: str):
        super().__init__(last)
        self.last = last


def backoff_delay(backoff_s: float, retry: int) -> float:
    """Seconds to wait before retry number `retry` (1, 2, ...): backoff_s, 2 backoff_s, 4 backoff_s, ... capped.

    >>> [backoff_delay(1.0, k) for k in (1, 2, 3, 4, 5, 6)]
    [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    """
    return min(backoff_s * 2 ** (retry - 1), MAX_BACKOFF_S)


def send_with_retries(
    send: Callable[[], httpx.Response],
    retries: int,
    backoff_s: float,
    describe: Callable[[httpx.Response], str] = lambda response: f"HTTP {response.status_code}",
    retry_status: Callable[[httpx.Response], bool] | None = None,
    on_retry: Callable[[int, float, str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> httpx.Response:
    """`send()` up to `retries` + 1 times; the first answer that is not retried.

    `retry_status(response)` False on a retried status returns that response instead of retrying it (a caller that
    polls). `on_retry(retry, delay, last)` is called before each wait (to log it). A transport error that no attempt
    can get past (a URL without a scheme) propagates at once; after the last attempt, `RetriesExhausted`.
    """
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            delay = backoff_delay(backoff_s, attempt)
            if on_retry is not None:
                on_retry(attempt, delay, last)
            sleep(delay)
        try:
            response = send()
        except RETRIED_ERRORS as exc:  # refused, reset, DNS, timeout, closed before answering
            last = f"{type(exc).__name__}: {exc}"
            continue
        if response.status_code in RETRIED_STATUS and (retry_status is None or retry_status(response)):
            last = describe(response)
            continue
        return response
    raise RetriesExhausted(last)
