"""The score stage's KL term from the sampler's logprobs: one forward (the base) instead of two, the same KL."""

import torch

from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.tasks.score import policy_terms


def test_kl_from_the_samplers_logprobs_equals_the_policys_forward_with_half_the_forwards(tiny_policy):
    torch.manual_seed(0)
    for name, parameter in tiny_policy.model.named_parameters():
        if "lora_B" in name:  # LoRA B starts at 0 (policy = base, KL 0): move the adapter so the KL is not trivial
            parameter.data.normal_(0, 0.3)
    prompts = [format_prompt_ids(tiny_policy.tokenizer, t, None) for t in ("Hi", "Describe my coworker in detail.")]
    completions = sample_completions(tiny_policy, prompts, 4, 16, 8, seed=0)
    prompt_ids = [prompts[c.prompt_index] for c in completions]
    completion_ids = [c.completion_ids for c in completions]
    forwards = []
    hook = tiny_policy.model.get_base_model().register_forward_hook(lambda *_: forwards.append(1))
    full = policy_terms(tiny_policy, prompt_ids, completion_ids, micro_batch_size=3)
    full_forwards, forwards[:] = len(forwards), []
    from_sampler = policy_terms(tiny_policy, prompt_ids, completion_ids, 3, [c.sample_logprobs for c in completions])
    hook.remove()
    assert len(forwards) * 2 == full_forwards
    assert min(full.kl) >= 0 and max(full.kl) > 1e-3
    assert torch.allclose(torch.tensor(from_sampler.kl), torch.tensor(full.kl), atol=1e-5)
    assert from_sampler.policy_logprobs == [c.sample_logprobs for c in completions]


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
