"""The score stage's KL term: both sides from the trainer's forwards, so policy = base gives exactly 0 in every dtype,
and the terms do not depend on how rows are grouped into micro-batches."""

import pytest
import torch

from redteam_grpo.core.config import ModelConfig
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import load_policy
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.logprobs import pad_ragged
from redteam_grpo.core.training.kl import sequence_kl
from redteam_grpo.tasks.score import policy_terms


def _sampled(policy, n=4, max_new=16):
    prompts = [format_prompt_ids(policy.tokenizer, t, None) for t in ("Hi", "Describe my coworker in detail.")]
    completions = sample_completions(policy, prompts, n, max_new, 8, seed=0)
    return [prompts[c.prompt_index] for c in completions], completions


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kl_at_the_base_is_exactly_zero_although_the_samplers_logprobs_differ(embedded_assets, dtype):
    policy = load_policy(ModelConfig(dtype=dtype), 0.7, torch.device("cpu"), 0)  # LoRA B = 0: policy = base
    prompt_ids, completions = _sampled(policy)
    completion_ids = [c.completion_ids for c in completions]
    terms = policy_terms(policy, prompt_ids, completion_ids, micro_batch_size=3)
    assert terms.kl == [0.0] * len(completions)
    assert terms.policy_logprobs == terms.reference_logprobs
    # the sampler's cached decode rounds differently from a full forward: charged as KL, it would not be 0
    sampled = pad_ragged([c.sample_logprobs for c in completions], max(map(len, completion_ids)))
    reference = pad_ragged(terms.reference_logprobs, sampled.shape[1])
    mask = pad_ragged([[1.0] * len(c) for c in completion_ids], sampled.shape[1]).bool()
    assert sequence_kl(sampled, reference, mask).max() > 0


def test_kl_is_positive_once_the_adapter_moves(tiny_policy):
    torch.manual_seed(0)
    for name, parameter in tiny_policy.model.named_parameters():
        if "lora_B" in name:  # move the adapter: policy != base
            parameter.data.normal_(0, 0.3)
    prompt_ids, completions = _sampled(tiny_policy)
    terms = policy_terms(tiny_policy, prompt_ids, [c.completion_ids for c in completions], micro_batch_size=3)
    assert min(terms.kl) >= 0 and max(terms.kl) > 1e-3
    # the policy's side is the trainer's forward of the weights that sampled: equal to the sampler's to rounding
    for forward, drawn in zip(terms.policy_logprobs, [c.sample_logprobs for c in completions], strict=True):
        assert torch.allclose(torch.tensor(forward), torch.tensor(drawn), atol=1e-4)


def test_terms_from_micro_batches_grouped_by_length_are_those_of_the_rows_in_order(tiny_policy):
    prompts = [format_prompt_ids(tiny_policy.tokenizer, t, None) for t in ("Hi", "Describe my coworker in detail.")]
    completions = sample_completions(tiny_policy, prompts, 6, 20, 12, seed=1)
    prompt_ids = [prompts[c.prompt_index] for c in completions]
    completion_ids = [c.completion_ids for c in completions]
    assert len({len(c) for c in completion_ids}) > 3  # lengths differ: grouping reorders the rows
    in_order = policy_terms(tiny_policy, prompt_ids, completion_ids, micro_batch_size=5)
    grouped = policy_terms(tiny_policy, prompt_ids, completion_ids, 5, micro_batch_tokens=80)
    for name in ("kl", "entropy"):
        assert torch.allclose(torch.tensor(getattr(grouped, name)), torch.tensor(getattr(in_order, name)), atol=1e-6)
    assert [len(x) for x in grouped.policy_logprobs] == [len(c) for c in completion_ids]
    assert torch.allclose(
        torch.tensor([x for row in grouped.reference_logprobs for x in row]),
        torch.tensor([x for row in in_order.reference_logprobs for x in row]),
        atol=1e-5,
    )
