"""Capability through the lm-evaluation-harness: the model it scores is the one asked for (adapter on or off), and
its accuracy is the one a hand computation of the same multiple choice gives."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from redteam_grpo.core.capability import BUNDLED_TASK, CapabilityError, CapabilitySuite, parse_capability
from redteam_grpo.core.evaluation import EvaluationOptions

LIMIT = 12


def _documents() -> list[dict]:
    text = (resources.files("redteam_grpo.core.resources") / "embedded_replies.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()][:LIMIT]


def _hand_accuracy(policy) -> float:
    """argmax over the choices of log P(" " + choice | question), as lm-eval's `acc` defines it: the context's
    tokens, then the continuation's tokens taken from the tokenization of the whole text."""
    tok, hits = policy.tokenizer, 0
    for doc in _documents():
        context = tok(doc["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in doc["choices"]:
            whole = tok(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            continuation = whole[len(context) :]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logprobs = torch.log_softmax(policy.model(input_ids=ids).logits[0].float(), -1)
            start = len(whole) - len(continuation)
            scores.append(sum(logprobs[start - 1 + i, t].item() for i, t in enumerate(continuation)))
        hits += max(range(len(scores)), key=scores.__getitem__) == doc["gold"]
    return hits / LIMIT


def test_the_suite_scores_the_model_as_set_and_agrees_with_a_hand_computation(tiny_policy, tmp_path):
    suite = CapabilitySuite([BUNDLED_TASK], tmp_path / "lm-eval.log", limit=LIMIT)
    with tiny_policy.reference():
        base = suite.scores(tiny_policy.model, tiny_policy.tokenizer)[BUNDLED_TASK]
        assert base["acc"] == pytest.approx(_hand_accuracy(tiny_policy))
    torch.manual_seed(0)
    with torch.no_grad():  # an adapter that changes the model a lot
        for name, parameter in tiny_policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    adapted = suite.scores(tiny_policy.model, tiny_policy.tokenizer)[BUNDLED_TASK]
    assert adapted != base
    assert adapted["acc"] == pytest.approx(_hand_accuracy(tiny_policy))
    with tiny_policy.reference():  # the adapter off again: the base's numbers, whatever the adapter holds
        assert suite.scores(tiny_policy.model, tiny_policy.tokenizer)[BUNDLED_TASK] == base
    # lm-eval's own output went to the log, not the console
    assert "loglikelihood" in (tmp_path / "lm-eval.log").read_text()


def test_an_unknown_suite_or_task_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(CapabilityError, match=r"the suite is lm-eval, as in 'lm-eval:arc_easy"):
        parse_capability("olmes:arc")
    with pytest.raises(CapabilityError, match=r"the suite is lm-eval"):
        parse_capability("lm-eval:")
    with pytest.raises(ValueError, match=r"the suite is lm-eval"):
        EvaluationOptions(capability="arc_easy")
    with pytest.raises(CapabilityError, match=r"no_such_task: not an lm-eval task \(`lm-eval ls tasks`"):
        CapabilitySuite([BUNDLED_TASK, "no_such_task"], tmp_path / "lm-eval.log")
    # a real task whose dataset is not in the cache (and no network here): refused by name, with the way out
    with pytest.raises(CapabilityError, match=r"the dataset of lm-eval task arc_easy could not be loaded .*cache"):
        CapabilitySuite(["arc_easy"], tmp_path / "lm-eval.log")
    assert EvaluationOptions(transfer_to="a/b, c").transfer_to == ["a/b", "c"]
