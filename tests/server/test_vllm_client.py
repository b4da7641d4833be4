"""The vLLM sampler's client against the stand-in that speaks vLLM's protocol (tests/doubles/vllm_server.py), and
against answers outside the rollouts contract."""

from __future__ import annotations

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.training.kl import policy_reference_logprobs
from redteam_grpo.server.vllm_client import PEFT_ADAPTER_FILE, SamplerError, VllmSampler, adapter_name
from tests.doubles.vllm_server import build_app

PROMPTS = ["Hi", "Describe my coworker in detail.", "What do you think of the people next door?"]


@pytest.fixture(scope="module")
def stand_in(embedded_assets):
    with TestClient(build_app("embedded:tiny-qwen3")) as http:
        yield http


def _export(policy, folder):
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:  # away from the base, so an adapter that is not applied shows
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    policy.model.save_pretrained(folder, selected_adapters=[DEFAULT_ROLE], save_embedding_layers=False)
    return adapter_name("run", 0, folder / PEFT_ADAPTER_FILE)


def test_every_prompt_of_a_call_draws_from_its_own_random_stream(stand_in, tiny_policy):
    # Bug class engine-seed-shared-across-prompts (docs/bug-classes.md): vLLM seeds every prompt of one request with
    # the request's seed, so one request of several prompts draws the k-th completion of each from the same stream.
    # The same prompt twice in one call must not come back as the same completions twice.
    client = VllmSampler("http://testserver", http=stand_in)
    prompt = format_prompt_ids(tiny_policy.tokenizer, PROMPTS[1], None)
    eot, suppressed = tiny_policy.end_of_turn_ids, tiny_policy.distribution.suppressed_ids
    drawn = client.sample(_base(stand_in), [prompt, prompt], 4, 12, 1.0, 5, eot, suppressed)
    first, second = ([c.completion_ids for c in drawn if c.prompt_index == p] for p in (0, 1))
    assert first != second, first
    again = client.sample(_base(stand_in), [prompt, prompt], 4, 12, 1.0, 5, eot, suppressed)
    assert [c.completion_ids for c in again] == [c.completion_ids for c in drawn]  # and a call is reproducible


def _base(stand_in) -> str:
    """The base model's name as the stand-in serves it."""
    return stand_in.get("/v1/models").json()["data"][0]["id"]


def test_completions_fill_the_rollouts_contract_with_the_adapters_logprobs(stand_in, tiny_policy, tmp_path):
    name = _export(tiny_policy, tmp_path / "adapter")
    client = VllmSampler("http://testserver", http=stand_in)
    client.load_adapter(name, tmp_path / "adapter")
    prompt_ids = [format_prompt_ids(tiny_policy.tokenizer, p, None) for p in PROMPTS]
    eot = tiny_policy.end_of_turn_ids
    completions = client.sample(
        name, prompt_ids, 4, 16, tiny_policy.distribution.temperature, 5, eot, tiny_policy.distribution.suppressed_ids
    )

    assert [(c.prompt_index, c.sample_idx) for c in completions] == [(p, g) for p in range(3) for g in range(4)]
    suppressed = set(tiny_policy.distribution.suppressed_ids)
    for c in completions:
        assert len(c.sample_logprobs) == len(c.completion_ids) > 0
        assert not suppressed & set(c.completion_ids)
        assert (c.finish_reason == "stop") == (c.completion_ids[-1] in eot)
        assert not set(c.completion_ids[:-1]) & set(eot)
    # the logprobs are the trainer's, on the adapter's tempered distribution, not the base's
    rows = [prompt_ids[c.prompt_index] for c in completions]
    ids = [c.completion_ids for c in completions]
    trainer, base, mask = policy_reference_logprobs(tiny_policy, rows, ids)
    sampled = torch.zeros_like(trainer)
    for b, c in enumerate(completions):
        sampled[b, : len(c.sample_logprobs)] = torch.tensor(c.sample_logprobs)
    assert (sampled - trainer)[mask].abs().max() < 1e-4
    assert (sampled - base)[mask].abs().max() > 1e-2


def test_loading_again_unloading_and_an_unknown_adapter_follow_vllms_answers(stand_in, tiny_policy, tmp_path):
    name = _export(tiny_policy, tmp_path / "adapter")
    VllmSampler("http://testserver", http=stand_in).load_adapter(name, tmp_path / "adapter")
    again = VllmSampler("http://testserver", http=stand_in)
    again.load_adapter(name, tmp_path / "adapter")  # 400 "already been loaded" from another client: the same name
    again.unload_adapter(name)
    again.unload_adapter(name)  # 404: nothing to unload
    with pytest.raises(SamplerError, match="HTTP 404"):
        again.sample(
            name, [[1, 2, 3]], 2, 4, 1.0, 0, tiny_policy.end_of_turn_ids, tiny_policy.distribution.suppressed_ids
        )


def _answering(body):
    return httpx.Client(
        base_url="http://sampler", transport=httpx.MockTransport(lambda request: httpx.Response(200, json=body))
    )


def _choice(index, ids, logprobs, reason):
    return {"index": index, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}, "finish_reason": reason}


def test_a_response_from_another_adapter_is_refused():
    body = {"model": "run-v3-0123456789ab", "choices": [_choice(0, [5, 6], [-1.0, -2.0], "length")]}
    client = VllmSampler("http://sampler", http=_answering(body))
    with pytest.raises(SamplerError, match="not from the policy being trained"):
        client.sample("run-v4-ba9876543210", [[1, 2]], 1, 2, 1.0, 0, [9], [7])


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        (_choice(0, [5, 9, 6], [-1.0, -1.0, -1.0], "length"), "past an end-of-turn token"),
        (_choice(0, [5, 6], [-1.0], "length"), "without a logprob"),
        (_choice(0, [5, 6], [-1.0, -9999.0], "length"), "probability 0"),
        (_choice(0, [5, 7], [-1.0, -1.0], "length"), "suppressed ids"),  # a bias the server did not apply
        ({"index": 0, "finish_reason": "length", "logprobs": None}, "no token ids or logprobs"),
    ],
)
def test_answers_outside_the_rollouts_contract_are_refused(choice, message):
    client = VllmSampler("http://sampler", http=_answering({"model": "a", "choices": [choice]}))
    with pytest.raises(SamplerError, match=message):
        client.sample("a", [[1, 2]], 1, 3, 1.0, 0, [9], [7])


def test_a_url_no_request_can_be_sent_to_names_the_setting():
    client = VllmSampler("localhost:8100")  # no scheme: no attempt could send it, so none is retried
    with pytest.raises(SamplerError, match=r"check sampling\.vllm_url"):
        client.wait_ready(timeout_s=1)
    with pytest.raises(SamplerError, match=r"check sampling\.vllm_url"):
        client.sample("a", [[1, 2]], 1, 3, 1.0, 0, [9], [7])


def test_an_unreachable_server_is_an_error_that_names_the_way_out():
    client = VllmSampler("http://127.0.0.1:9", retries=1, backoff_s=0.0, timeout_s=2)
    with pytest.raises(SamplerError, match="serve-sampler"):
        client.sample("a", [[1, 2]], 1, 3, 1.0, 0, [9], [7])


def test_an_adapters_name_is_a_digest_of_its_weights(tiny_policy, tmp_path):
    first = _export(tiny_policy, tmp_path / "first")
    tiny_policy.model.save_pretrained(tmp_path / "same", selected_adapters=[DEFAULT_ROLE], save_embedding_layers=False)
    with torch.no_grad():
        next(p for n, p in tiny_policy.model.named_parameters() if "lora_B" in n).add_(1e-3)
    tiny_policy.model.save_pretrained(tmp_path / "moved", selected_adapters=[DEFAULT_ROLE], save_embedding_layers=False)
    # the same version redone with other weights gets another name: the server's cache never serves the old ones
    assert adapter_name("run", 0, tmp_path / "same" / PEFT_ADAPTER_FILE) == first
    assert adapter_name("run", 0, tmp_path / "moved" / PEFT_ADAPTER_FILE) != first


KEY = "sampler-key-of-32-characters-xyz"


class KeyRecorder:
    """Answers what the client asks of a vLLM server, and keeps each request's path and Authorization header."""

    def __init__(self, status: int = 200):
        self.status = status
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.path, request.headers.get("authorization")))
        if self.status != 200:
            return httpx.Response(self.status, json={"error": "Unauthorized"})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"model": "a", "choices": [_choice(0, [5, 9], [-1.0, -1.0], "stop")]})
        return httpx.Response(200, text="ok")


def _recording(server: KeyRecorder) -> httpx.Client:
    return httpx.Client(base_url="http://sampler", transport=httpx.MockTransport(server))


def _every_request(client: VllmSampler, folder) -> None:
    client.wait_ready(timeout_s=1)
    client.load_adapter("a", folder)
    client.sample("a", [[1, 2]], 1, 3, 1.0, 0, [9], [7])
    client.unload_adapter("a")


def test_the_client_sends_the_api_key_on_every_request(tmp_path, monkeypatch):
    monkeypatch.delenv("REDTEAM_GRPO_SAMPLER_TOKEN", raising=False)
    server = KeyRecorder()
    _every_request(VllmSampler("http://sampler", http=_recording(server), token=KEY), tmp_path)
    paths = ["/health", "/v1/load_lora_adapter", "/v1/completions", "/v1/unload_lora_adapter"]
    assert server.seen == [(path, f"Bearer {KEY}") for path in paths]

    monkeypatch.setenv("REDTEAM_GRPO_SAMPLER_TOKEN", KEY)  # as the runs' tasks build it: from the environment
    from_environment = KeyRecorder()
    _every_request(VllmSampler("http://sampler", http=_recording(from_environment)), tmp_path)
    assert from_environment.seen == server.seen

    monkeypatch.setenv("REDTEAM_GRPO_SAMPLER_TOKEN", "")  # empty: no key, not an empty one
    without = KeyRecorder()
    _every_request(VllmSampler("http://sampler", http=_recording(without)), tmp_path)
    assert [header for _, header in without.seen] == [None] * 4


@pytest.mark.parametrize(("token", "sent"), [(KEY, "the key in REDTEAM_GRPO_SAMPLER_TOKEN"), ("", "no key")])
def test_a_refused_key_is_an_error_that_names_the_variable(tmp_path, token, sent):
    client = VllmSampler("http://sampler", http=_recording(KeyRecorder(status=401)), token=token)
    with pytest.raises(SamplerError, match="HTTP 401") as err:
        client.load_adapter("a", tmp_path)
    assert sent in str(err.value) and "Set REDTEAM_GRPO_SAMPLER_TOKEN to the key the server was started with" in str(
        err.value
    )
