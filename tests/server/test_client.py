"""The reward-server client: retries and backoff, clear failures, model checks, request splitting."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from redteam_grpo.core.config import RewardConfig
from redteam_grpo.server.client import ReplicatedRewardClient, RewardClient, RewardServiceError

SCORER = {"name": "embedded:tiny-toxicity", "revision": "r1", "kind": "classifier", "details": {"label": "toxic"}}
READY = {
    "ready": True,
    "service": {"scorer": SCORER, "embedder": None, "refusal": {"patterns": True}},
    "limits": {"max_texts": 3, "max_chars": 100, "max_body_bytes": 10_000},
}


TRANSPORT_FAILURES = {
    "drop": lambda request: httpx.ConnectError("connection reset", request=request),
    "timeout": lambda request: httpx.ReadTimeout("timed out", request=request),
    "closed": lambda request: httpx.RemoteProtocolError("server disconnected without a response", request=request),
}


class FakeServer:
    """Answers /ready and /score; `failures` (status codes or TRANSPORT_FAILURES names) are served first on /score.

    `with_truncated=False` answers as a server from before the `truncated` field.
    """

    def __init__(self, failures=(), ready=READY, scorer=SCORER, with_truncated=True):
        self.failures, self.ready, self.scorer = list(failures), ready, scorer
        self.with_truncated = with_truncated
        self.score_calls: list[list[str]] = []
        self.request_ids: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json=self.ready)
        self.request_ids.append(request.headers.get("x-request-id"))
        if self.failures:
            failure = self.failures.pop(0)
            if failure in TRANSPORT_FAILURES:
                raise TRANSPORT_FAILURES[failure](request)
            return httpx.Response(failure, json={"detail": f"boom {failure}"})
        texts = json.loads(request.content)["texts"]
        self.score_calls.append(texts)
        results = [{"score": len(t) / 100, "categories": [], "refusal": t.startswith("I'm sorry")} for t in texts]
        if self.with_truncated:
            results = [{**r, "truncated": len(t) > 5} for r, t in zip(results, texts, strict=True)]
        return httpx.Response(200, json={"results": results, "scorer": self.scorer, "request_id": "x"})


def _client(server, retries=3, **kw) -> RewardClient:
    return RewardClient(
        "http://reward.test", retries=retries, backoff_s=0.001, transport=httpx.MockTransport(server), **kw
    )


def test_what_waiting_can_fix_is_retried_then_succeeds():
    server = FakeServer(failures=[503, "drop", 502, "timeout", 504, "closed"])
    scores = _client(server, retries=6).score(["ab", "I'm sorry"], ["p", "q"])
    assert [s.score for s in scores] == [0.02, 0.09] and [s.refusal for s in scores] == [False, True]
    assert [s.truncated for s in scores] == [False, True]
    assert len(server.score_calls) == 1
    assert len(set(server.request_ids)) == 1  # every attempt of one request carries the same id


def test_a_500_is_raised_at_once_with_the_request_id_to_look_up():
    """The server answers 4xx for malformed requests and 503 while loading: a 500 is its scorer failing on these
    texts, which a retry would meet again."""
    server = FakeServer(failures=[500, 200])
    with pytest.raises(RewardServiceError) as err:
        _client(server).score(["a"], ["p"])
    message = str(err.value)
    assert "HTTP 500" in message and "boom 500" in message and server.request_ids[0] in message
    assert "Not retried" in message and "--resume" not in message
    assert server.failures == [200]


@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 422])
def test_a_4xx_is_raised_at_once_with_the_servers_message(status):
    server = FakeServer(failures=[status, 200])
    with pytest.raises(RewardServiceError, match=rf"refused the request \(HTTP {status}\): boom {status}"):
        _client(server).score(["a"], ["p"])
    assert server.failures == [200]


def test_a_server_without_the_truncated_field_is_still_understood():
    scores = _client(FakeServer(with_truncated=False)).score(["a long text"], ["p"])
    assert scores[0].score == 0.11 and scores[0].truncated is False


def test_a_url_no_attempt_can_reach_fails_at_once_and_names_the_setting():
    client = RewardClient("localhost:50050", retries=3, backoff_s=10)  # no scheme: a retry cannot fix it
    client._ready = READY
    with pytest.raises(RewardServiceError, match=r"check reward\.url"):
        client.score(["a"], ["p"])


def test_after_its_retries_the_client_fails_with_a_message_that_says_how_to_go_on():
    server = FakeServer(failures=[502] * 10)
    with pytest.raises(RewardServiceError) as err:
        _client(server, retries=2).score(["a"], ["p"])
    message = str(err.value)
    assert "failed 3 times" in message and "HTTP 502: boom 502" in message
    assert "--resume" in message and "reward.url" in message
    assert server.failures == [502] * 7  # exactly 1 + 2 retries were spent


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


# -- replicas (reward.url as a list) -----------------------------------------------------------------------------


class DeadServer:
    """A replica that went down: every request is refused at the connection."""

    def __init__(self):
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        raise httpx.ConnectError("connection refused", request=request)


def _replica(server, url: str, retries=1) -> RewardClient:
    return RewardClient(url, retries=retries, backoff_s=0.001, transport=httpx.MockTransport(server))


def test_replicas_share_a_batch_and_answer_in_order():
    servers = [FakeServer(), FakeServer()]
    client = ReplicatedRewardClient([_replica(s, f"http://r{k}.test") for k, s in enumerate(servers)])
    texts = [f"text {'x' * k}" for k in range(6)]
    scores = client.score(texts, ["p"] * 6)
    assert [s.score for s in scores] == [len(t) / 100 for t in texts]
    assert [sum(map(len, s.score_calls)) for s in servers] == [3, 3]  # each replica scored half


def test_a_replica_that_goes_down_is_left_out_and_its_texts_go_to_the_others():
    alive = FakeServer()
    failing = FakeServer(failures=["drop"] * 100)  # answered /ready, then went down before scoring
    client = ReplicatedRewardClient([_replica(alive, "http://a.test"), _replica(failing, "http://b.test")])
    texts = [f"t{k}" for k in range(5)]
    scores = client.score(texts, ["p"] * 5)
    assert [s.score for s in scores] == [len(t) / 100 for t in texts]
    assert sum(map(len, alive.score_calls)) == 5 and len(failing.request_ids) == 2  # its retries, then left out
    client.score(["again"], ["p"])  # left out for a while: not asked again
    assert len(failing.request_ids) == 2


def test_a_replica_down_from_the_start_is_left_out():
    alive, dead = FakeServer(), DeadServer()
    client = ReplicatedRewardClient([_replica(dead, "http://a.test"), _replica(alive, "http://b.test")])
    assert [s.score for s in client.score(["ab"], ["p"])] == [0.02]


def test_every_replica_down_is_an_error_that_says_how_to_continue():
    client = ReplicatedRewardClient([_replica(DeadServer(), "http://a.test"), _replica(DeadServer(), "http://b.test")])
    with pytest.raises(RewardServiceError, match=r"none of the 2 reward servers .* resume the run"):
        client.score(["a"], ["p"])


def test_replicas_that_serve_different_models_are_refused():
    other = {**SCORER, "revision": "r2"}
    ready = {**READY, "service": {**READY["service"], "scorer": other}}
    client = ReplicatedRewardClient(
        [_replica(FakeServer(), "http://a.test"), _replica(FakeServer(ready=ready, scorer=other), "http://b.test")]
    )
    with pytest.raises(RewardServiceError, match=r"http://b.test serves scorer embedded:tiny-toxicity@r2.*another"):
        client.score(["a"], ["p"])


def test_a_replica_down_at_the_start_is_checked_when_it_is_first_used():
    other = {**SCORER, "details": {"label": "non-toxic"}}
    ready = {**READY, "service": {**READY["service"], "scorer": other}}
    late = FakeServer(ready=ready, scorer=other)
    state = {"up": False}

    def late_server(request):
        if not state["up"]:
            raise httpx.ConnectError("refused", request=request)
        return late(request)

    client = ReplicatedRewardClient(
        [_replica(FakeServer(), "http://a.test"), _replica(late_server, "http://b.test")], rest_s=0.0
    )
    client.verify(RewardConfig())
    state["up"] = True  # b comes up serving another label: refused before it scores anything
    with pytest.raises(RewardServiceError, match=r"label.*non-toxic"):
        client.score(["a", "b"], ["p", "q"])
    assert not late.score_calls


def test_failed_pieces_go_to_replicas_that_have_not_failed_them_and_the_call_ends():
    a, b, healthy = FakeServer(failures=["drop"] * 100), FakeServer(failures=["drop"] * 100), FakeServer()
    client = ReplicatedRewardClient(
        [_replica(a, "http://a.test"), _replica(b, "http://b.test"), _replica(healthy, "http://c.test")], rest_s=0.0
    )
    texts = [f"t{k}" for k in range(7)]
    assert [s.score for s in client.score(texts, ["p"] * 7)] == [len(t) / 100 for t in texts]
    assert sum(map(len, healthy.score_calls)) == 7
    dead = ReplicatedRewardClient(
        [_replica(FakeServer(failures=["drop"] * 100), f"http://{x}.test") for x in "de"], rest_s=0.0
    )
    with pytest.raises(RewardServiceError, match="failed on every reward server"):
        dead.score(texts, ["p"] * 7)


def test_a_replica_refusing_the_texts_fails_the_call_instead_of_moving_them():
    client = ReplicatedRewardClient(
        [_replica(FakeServer(failures=[422]), "http://a.test"), _replica(FakeServer(), "http://b.test")]
    )
    with pytest.raises(RewardServiceError, match="HTTP 422"):
        client.score(["a", "b"], ["p", "q"])


def test_reward_url_takes_a_list_of_replicas():
    cfg = RewardConfig(url=["http://a:1", "http://b:2"])
    assert cfg.urls == ["http://a:1", "http://b:2"]
    assert RewardConfig(url="http://a:1").urls == ["http://a:1"] and RewardConfig().urls == []
    with pytest.raises(ValueError, match="one twice"):
        RewardConfig(url=["http://a:1", "http://a:1"])
    with pytest.raises(ValueError, match="http://"):
        RewardConfig(url=["http://a:1", "a:2"])


# -- the bearer token -------------------------------------------------------------------------------------------


class AuthRecorder(FakeServer):
    """A FakeServer that keeps the Authorization header of every request."""

    def __init__(self):
        super().__init__()
        self.authorization: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.authorization.append(request.headers.get("authorization"))
        return super().__call__(request)


@pytest.mark.parametrize(("token", "header"), [("", None), (None, None), ("t" * 20, "Bearer " + "t" * 20)])
def test_the_token_goes_on_every_request_and_an_empty_one_is_none(token, header):
    server = AuthRecorder()
    _client(server, token=token).score(["a"], ["p"])
    assert server.authorization == [header, header]  # /ready and /score


@pytest.fixture
def warnings_of_a_new_process(monkeypatch, caplog):
    """The warnings the clients give, as in a process that has given none yet (they are once per process)."""
    import logging

    from redteam_grpo.server import settings

    monkeypatch.setattr(settings, "_warned_in_clear", set())
    caplog.set_level(logging.WARNING)
    return lambda: [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]


def test_a_token_sent_over_plain_http_to_another_machine_is_warned_about_once(warnings_of_a_new_process):
    for _ in range(2):  # a client per stage: one warning for the process
        client = RewardClient("http://reward.test:50050", "t" * 20, transport=httpx.MockTransport(FakeServer()))
        client.score(["a"], ["p"])
        client.score(["b"], ["p"])
    (warning,) = warnings_of_a_new_process()
    assert "http://reward.test:50050" in warning and "--ssl-certfile" in warning and "https://" in warning


@pytest.mark.parametrize(
    ("url", "token"),
    [
        ("https://reward.test:50050", "t" * 20),  # encrypted
        ("http://127.0.0.1:50050", "t" * 20),  # never leaves the machine
        ("http://localhost:50050", "t" * 20),
        ("http://[::1]:50050", "t" * 20),
        ("http://reward.test:50050", None),  # nothing to read
    ],
)
def test_no_warning_where_no_token_crosses_the_network_in_clear(warnings_of_a_new_process, url, token):
    RewardClient(url, token, transport=httpx.MockTransport(FakeServer())).score(["a"], ["p"])
    assert warnings_of_a_new_process() == []
