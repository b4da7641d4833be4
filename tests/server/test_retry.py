"""The one retry loop of the HTTP clients (server/retry.py), on scripted answers and a recorded clock."""

from __future__ import annotations

import httpx
import pytest

from redteam_grpo.server.retry import MAX_BACKOFF_S, RetriesExhausted, send_with_retries


def _script(*answers):
    """send(): each call the next answer, an httpx.Response for a status or an exception to raise."""
    calls = []

    def send() -> httpx.Response:
        calls.append(len(calls))
        answer = answers[len(calls) - 1]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer)

    return send, calls


def test_retried_errors_and_statuses_are_tried_again_with_doubling_capped_waits():
    send, calls = _script(httpx.ConnectError("refused"), 503, httpx.ReadTimeout("slow"), 502, 504, 200)
    waits, logged = [], []
    response = send_with_retries(
        send, retries=5, backoff_s=10.0, sleep=waits.append, on_retry=lambda k, d, last: logged.append((k, last))
    )
    assert response.status_code == 200 and len(calls) == 6
    assert waits == [10.0, 20.0, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]  # 10 x 2^k, capped at 30
    assert logged == [
        (1, "ConnectError: refused"),
        (2, "HTTP 503"),
        (3, "ReadTimeout: slow"),
        (4, "HTTP 502"),
        (5, "HTTP 504"),
    ]


@pytest.mark.parametrize("status", [200, 400, 404, 422, 500])
def test_an_answer_waiting_cannot_change_is_returned_at_once(status):
    send, calls = _script(status)
    waits = []
    assert send_with_retries(send, retries=4, backoff_s=1.0, sleep=waits.append).status_code == status
    assert len(calls) == 1 and waits == []


def test_after_the_last_retry_the_caller_hears_what_the_last_attempt_met():
    send, calls = _script(503, 503, httpx.ConnectError("refused"))
    waits = []
    with pytest.raises(RetriesExhausted) as exhausted:
        send_with_retries(send, retries=2, backoff_s=1.0, sleep=waits.append)
    assert len(calls) == 3 and waits == [1.0, 2.0] and exhausted.value.last == "ConnectError: refused"


def test_a_caller_that_polls_gets_the_retried_status_back_and_an_unsendable_url_fails_at_once():
    send, calls = _script(503)
    response = send_with_retries(send, retries=3, backoff_s=1.0, retry_status=lambda r: False, sleep=lambda s: None)
    assert response.status_code == 503 and len(calls) == 1
    send, calls = _script(httpx.UnsupportedProtocol("no scheme"))
    with pytest.raises(httpx.UnsupportedProtocol):
        send_with_retries(send, retries=3, backoff_s=1.0, sleep=lambda s: None)
    assert len(calls) == 1
