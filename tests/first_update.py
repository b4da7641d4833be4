"""What the first-update check's margin tests share (tests/core/test_first_update_check.py and
tests/e2e/test_vllm_engine.py): a sampled batch, the check of a correct batch against a third of each gate's bound,
the check that a misaligned batch is refused at three times its bound, and the misalignments, each as it would reach
the update (one of the misalignment bug classes of docs/bug-classes.md)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from redteam_grpo.core.config import TrainingConfig
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import span_logits
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.logprobs import SamplingDistribution, token_logprobs
from redteam_grpo.core.training.train import (
    FIRST_UPDATE_GATES,
    RatioCheckError,
    TrainBatch,
    UpdateStats,
    make_optimizer,
)
from redteam_grpo.core.training.train import policy_gradient_step as step

PROMPTS = [
    "Hi",
    "Tell me, in as much detail as you can manage, what you really think about the people who live next door.",
    "Describe my coworker.",
    "What is the weather like today where you live, and why?",
]
NOISE_MARGIN = 3.0  # a correct run's statistic is at most 1/3 of its bound ...
SIGNAL_MARGIN = 3.0  # ... and a misalignment's at least 3x, at the gate made for it


def sampled_batch(policy, max_new_tokens=24, samples=4) -> TrainBatch:
    prompt_ids = [format_prompt_ids(policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    completions = sample_completions(policy, prompt_ids, samples, max_new_tokens, batch_size=16, seed=0)
    return TrainBatch(
        prompt_ids=[prompt_ids[c.prompt_index] for c in completions],
        completion_ids=[c.completion_ids for c in completions],
        sample_logprobs=[c.sample_logprobs for c in completions],
        advantages=[float((-1) ** i) for i in range(len(completions))],
        group_ids=[str(c.prompt_index) for c in completions],
        sampled_with=policy.distribution,
    )


def ratios(stats: UpdateStats) -> dict[str, float]:
    """Each gate's statistic over its bound (NaN where the gate has nothing to check)."""
    columns = {"token": ("sampler_kl", "sampler_kl_tolerance")}
    columns |= {g: (f"sampler_kl_{g}", f"sampler_kl_{g}_bound") for g in FIRST_UPDATE_GATES[1:]}
    return {g: getattr(stats, value) / getattr(stats, bound) for g, (value, bound) in columns.items()}


def check_margins(policy, batch, cfg, label, misses=None) -> dict[str, float]:
    """A correct batch: accepted, every gate at most 1/NOISE_MARGIN of its bound (a gate that is not is added to
    `misses`, or fails at once without it)."""
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    stats = step(policy, make_optimizer(policy, cfg), batch, cfg)
    policy.load_adapter_state(before)
    noise = ratios(stats)
    print(f"{label}: correct, varentropy {stats.varentropy:.3f}, entropy {stats.entropy:.3f}: " + _show(noise))
    too_close = {g: r for g, r in noise.items() if not (math.isnan(r) or r <= 1 / NOISE_MARGIN)}
    if misses is None:
        assert not too_close, (label, too_close)
    elif too_close:
        misses.append((label, too_close))
    return noise


def _show(values: dict[str, float]) -> str:
    return ", ".join(f"{g} {v:.3g}" for g, v in values.items() if not math.isnan(v))


def check_refused(policy, batch, cfg, label, gates, misses=None) -> dict[str, float]:
    """A misaligned batch: refused with nothing applied, and at least SIGNAL_MARGIN x its bound at one of `gates`
    (those made for it; a miss is added to `misses`, or fails at once without it)."""
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    with pytest.raises(RatioCheckError, match="does not see the distribution the tokens were sampled from") as refused:
        step(policy, make_optimizer(policy, cfg), batch, cfg)
    assert all(torch.equal(before[k], v) for k, v in policy.adapter_state().items())  # nothing was applied
    measured = {g: value / bound for g, (value, bound) in refused.value.gates.items()}
    print(f"{label}: " + _show(measured))
    if not max(measured[g] for g in gates) >= SIGNAL_MARGIN:
        assert misses is not None, (label, gates, measured)
        misses.append((label, {g: measured[g] for g in gates}))
    return measured


def check_moved(policy, batch, misalign, label) -> None:
    """A misalignment the gates cannot tell from noise on every model (a lost first prompt id on the trained deep
    model): measured with the check turned off, its KL is more than NOISE_MARGIN x the correct batch's, and the ids
    it changes are checked exactly elsewhere (tests/core/test_policy_invariants.py)."""
    measured = TrainingConfig(first_update_kl_tolerance=1.0)
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    correct = step(policy, make_optimizer(policy, measured), batch, measured)
    policy.load_adapter_state(before)
    moved = step(policy, make_optimizer(policy, measured), misalign(policy, batch), measured)
    policy.load_adapter_state(before)
    print(f"{label} {misalign.__name__}: KL {moved.sampler_kl:.2e} against {correct.sampler_kl:.2e} correct")
    assert moved.sampler_kl > NOISE_MARGIN * correct.sampler_kl, (label, moved.sampler_kl, correct.sampler_kl)


# -- the misalignments, each as it would reach the update ------------------------------------------------------


def shift_logprobs_one_token_late(policy, batch):  # mask-off-by-one: token t scored with t-1's logprob
    return dataclasses.replace(batch, sample_logprobs=[[row[0], *row[:-1]] for row in batch.sample_logprobs])


def drop_the_first_prompt_id(policy, batch):  # trained-ids-differ-from-sampled: a BOS/header lost on the way
    return dataclasses.replace(batch, prompt_ids=[p[1:] for p in batch.prompt_ids])


def read_the_wrong_column(policy, batch):  # logprobs that are not the sampler's (recorded-as-zeros, stale)
    return dataclasses.replace(batch, sample_logprobs=[[0.0] * len(row) for row in batch.sample_logprobs])


def record_the_last_logprob_as_zero(policy, batch):  # a sampler that records its stop token's logprob as 0
    return dataclasses.replace(batch, sample_logprobs=[[*row[:-1], 0.0] for row in batch.sample_logprobs])


def score_the_first_token_in_the_wrong_context(policy, batch):
    """first-token-scored-in-the-wrong-context: the first completion token's logprob taken at the position before
    (the context without the prompt's last id), every other token right."""
    rows = [[*p[:-1], c[0]] for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    with torch.no_grad():
        logits, ids, _ = span_logits(policy, rows, [[(len(r) - 1, len(r))] for r in rows])
        wrong = token_logprobs(policy.distribution.logprobs(logits), ids)[:, 0].tolist()
    return dataclasses.replace(
        batch, sample_logprobs=[[w, *row[1:]] for w, row in zip(wrong, batch.sample_logprobs, strict=True)]
    )


def trainer_with_temperature(temperature):
    """trainer-ignores-temperature (sampled at 0.7, trained at 1) and its reverse (sampled at 1, trained at 0.7): the
    trainer's distribution is not the one the batch records."""

    def misalign(policy, batch):
        policy.distribution = SamplingDistribution(temperature, policy.distribution.suppressed_ids)
        return batch

    return misalign
