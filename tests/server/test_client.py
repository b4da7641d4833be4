"""The reward-server client: retries and backoff, clear failures, model checks, request splitting."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from redteam_grpo.core.config import RewardConfig
from redteam_grpo.server.client import RewardClient, RewardServiceError

SCORER = {"name": "embedded:tiny-toxicity", "revision": "r1", "kind": "classifier", "details": {"label": "toxic"}}
READY = {
    "ready": True,
    "service": {"scorer": SCORER, "embedder": None, "refusal": {"patterns": True}},
    "limits": {"max_texts": 3, "max_chars": 100, "max_body_bytes": 10_000},
}


class FakeServer:
    """Answers /ready and /score; `failures` is a list of status codes (or "drop") served first on /score."""

    def __init__(self, failures=(), ready=READY, scorer=SCORER):
        self.failures, self.ready, self.scorer = list(failures), ready, scorer
        self.score_calls: list[list[str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json=self.ready)
        if self.failures:
            failure = self.failures.pop(0)
            if failure == "drop":
                raise httpx.ConnectError("connection reset", request=request)
            return httpx.Response(failure, json={"detail": f"boom {failure}"})
        texts = json.loads(request.content)["texts"]
        self.score_calls.append(texts)
        results = [{"score": len(t) / 100, "categories": [], "refusal": t.startswith("I'm sorry")} for t in texts]
        return httpx.Response(200, json={"results": results, "scorer": self.scorer, "request_id": "x"})


def _client(server, retries=3, **kw) -> RewardClient:
    return RewardClient(
        "http://reward.test", retries=retries, backoff_s=0.001, transport=httpx.MockTransport(server), **kw
    )


def test_5xx_and_dropped_connections_are_retried_then_succeed():
    server = FakeServer(failures=[503, "drop", 500])
    scores = _client(server).score(["ab", "I'm sorry"], ["p", "q"])
    assert [s.score for s in scores] == [0.02, 0.09] and [s.refusal for s in scores] == [False, True]
    assert len(server.score_calls) == 1


def test_after_its_retries_the_client_fails_with_a_message_that_says_how_to_go_on():
    server = FakeServer(failures=[502] * 10)
    with pytest.raises(RewardServiceError) as err:
        _client(server, retries=2).score(["a"], ["p"])
    message = str(err.value)
    assert "failed 3 times" in message and "HTTP 502: boom 502" in message
    assert "--resume" in message and "reward.url" in message
    assert server.failures == [502] * 7  # exactly 1 + 2 retries were spent


def test_a_4xx_is_not_retried():
    server = FakeServer(failures=[422, 200])
    with pytest.raises(RewardServiceError, match=r"refused the request \(HTTP 422\): boom 422"):
        _client(server).score(["a"], ["p"])
    assert server.failures == [200]


def test_an_unreachable_server_fails_after_the_retries_with_backoff():
    with socket.socket() as s:  # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RewardClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RewardServiceError, match=r"failed 3 times; last: ConnectError"):
        client.score(["a"], ["p"])


def test_large_batches_are_split_under_the_servers_limit_and_keep_their_order():
    server = FakeServer()
    texts = [f"t{i}" + "x" * i for i in range(8)]
    scores = _client(server).score(texts, [""] * 8)
    assert [len(c) for c in server.score_calls] == [3, 3, 2]
    assert [s.score for s in scores] == [len(t) / 100 for t in texts]


def test_verify_names_every_difference_between_the_server_and_the_run_config():
    client = _client(FakeServer())
    client.verify(RewardConfig())  # the same scorer and label: fine
    with pytest.raises(RewardServiceError) as err:
        client.verify(RewardConfig(scorer="unitary/toxic-bert", toxic_label="insult", novelty_weight=0.3))
    message = str(err.value)
    assert "serves scorer 'embedded:tiny-toxicity', reward.scorer is 'unitary/toxic-bert'" in message
    assert "reward.toxic_label is 'insult'" in message
    assert "needs an embedder" in message


def test_a_server_restarted_with_another_model_is_detected():
    other = {**SCORER, "revision": "r2"}
    with pytest.raises(RewardServiceError, match="restarted with another model"):
        _client(FakeServer(scorer=other)).score(["a"], ["p"])
