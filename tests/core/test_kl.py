"""The KL term: the k3 estimator, and that it estimates KL(policy_T || reference_T) for the distribution sampled."""

import pytest
import torch

from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import completion_logits
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.logprobs import SamplingDistribution
from redteam_grpo.core.training.kl import (
    k3_kl,
    policy_entropy_reference_logprobs,
    policy_reference_logprobs,
    reference_logprobs,
    sequence_kl,
)

PROMPTS = [
    "Hi",
    "Tell me, in as much detail as you can manage, what you really think about the people who live next door.",
    "Describe my coworker.",
]


def test_k3_is_zero_when_policy_equals_reference_and_positive_otherwise():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    assert torch.equal(k3_kl(lp, lp, mask), torch.zeros(1, 3))
    ref = torch.tensor([[-1.5, -1.0, float("-inf")]])  # -inf at a masked position must not leak
    kl = k3_kl(lp, ref, mask)
    # r = ref - pol: -0.5 -> e^-0.5 + 0.5 - 1 = 0.10653; 1.0 -> e - 2 = 0.71828
    torch.testing.assert_close(kl, torch.tensor([[0.106531, 0.718282, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(sequence_kl(lp, ref, mask), torch.tensor([(0.106531 + 0.718282) / 2]), atol=1e-5, rtol=0)


def test_k3_estimates_the_true_kl_from_policy_samples():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    true_kl = (p * (p / q).log()).sum()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = k3_kl(p.log()[samples][None], q.log()[samples][None], torch.ones(1, 200_000, dtype=torch.bool)).mean()
    assert abs(estimate - true_kl) < 0.01


def _exact_kl_B_C(policy_logprobs_B_C_V: torch.Tensor, reference_logprobs_B_C_V: torch.Tensor) -> torch.Tensor:
    """sum_v p(v) (log p(v) - log q(v)) at every position, with 0 log 0 = 0 (suppressed ids)."""
    p = policy_logprobs_B_C_V.exp()
    terms = torch.where(p > 0, p * (policy_logprobs_B_C_V - reference_logprobs_B_C_V), torch.zeros_like(p))
    return terms.sum(-1)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_kl_estimate_is_unbiased_for_the_kl_between_the_distributions_sampled_at_any_temperature(
    tiny_policy, temperature
):
    # A perturbed adapter, so the policy is far from the reference (exact per-token KL of the order of a nat).
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in tiny_policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.35)
    tiny_policy.distribution = SamplingDistribution(temperature, tiny_policy.distribution.suppressed_ids)
    prompt_ids = [format_prompt_ids(tiny_policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    completions = sample_completions(tiny_policy, prompt_ids, group_size=8, max_new_tokens=24, batch_size=24, seed=0)
    prompts = [prompt_ids[c.prompt_index] for c in completions]
    ids = [c.completion_ids for c in completions]

    policy_lp, reference_lp, mask = policy_reference_logprobs(tiny_policy, prompts, ids)

    # The distributions the sampler draws from (temperature and suppressed ids applied to the policy's and to the
    # reference's logits), over the whole vocabulary at every sampled position.
    with torch.no_grad():
        logits, _, exact_mask = completion_logits(tiny_policy, prompts, ids)
        with tiny_policy.reference():
            reference_logits, _, _ = completion_logits(tiny_policy, prompts, ids)
    dist = tiny_policy.distribution
    policy_all_N_V = dist.logprobs(logits)[exact_mask].double()
    reference_all_N_V = dist.logprobs(reference_logits)[exact_mask].double()
    assert torch.equal(mask, exact_mask) and exact_mask.sum() > 200

    # 1. The estimator reads the sampled tokens' logprobs under those distributions, both sides: the sampler's own
    #    record of what it drew from, and the reference's under the same temperature.
    sampled_N = torch.tensor([t for c in completions for t in c.completion_ids])
    drawn_N = torch.tensor([lp for c in completions for lp in c.sample_logprobs], dtype=torch.float64)
    torch.testing.assert_close(policy_lp[mask].double(), drawn_N, atol=2e-4, rtol=0)
    reference_at_sampled_N = reference_all_N_V.gather(-1, sampled_N[:, None])[:, 0]
    torch.testing.assert_close(reference_lp[mask].double(), reference_at_sampled_N, atol=2e-4, rtol=0)

    # 2. Given its prefix, the k3 term's expectation over the sampled token is exactly the position's KL: k3 at every
    #    vocabulary entry, weighted by the policy's probability of drawing it (0 · k3 = 0 for suppressed ids).
    #    An exact identity, so no sampling noise: the k3 sample mean is heavy-tailed at this distance and its
    #    standard error is not a sound bound.
    p_N_V = policy_all_N_V.exp()
    support = p_N_V > 0
    k3_N_V = k3_kl(policy_all_N_V, reference_all_N_V, support)
    expected_k3_N = torch.where(support, p_N_V * k3_N_V, torch.zeros_like(p_N_V)).sum(-1)
    exact_N = _exact_kl_B_C(policy_all_N_V, reference_all_N_V)
    assert exact_N.mean() > 0.5
    torch.testing.assert_close(expected_k3_N, exact_N, atol=1e-5, rtol=1e-5)


def test_at_a_zero_adapter_one_forward_gives_both_sides_as_the_reference_forward_would_and_never_elsewhere(
    tiny_policy,
):
    prompt_ids = [format_prompt_ids(tiny_policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    completions = sample_completions(tiny_policy, prompt_ids, group_size=2, max_new_tokens=12, batch_size=6, seed=0)
    prompts, ids = [prompt_ids[c.prompt_index] for c in completions], [c.completion_ids for c in completions]
    forwards = []
    hook = tiny_policy.model.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))

    assert tiny_policy.adapter_is_zero()  # PEFT's initial B
    policy_lp, reference_lp, _, mask = policy_entropy_reference_logprobs(tiny_policy, prompts, ids)
    assert len(forwards) == 1
    skipped, _ = reference_logprobs(tiny_policy, prompts, ids)
    assert torch.equal(reference_lp[mask], skipped[mask])  # what the forward it saved would have given, bit for bit
    assert torch.equal(sequence_kl(policy_lp, reference_lp, mask), torch.zeros(len(ids)))

    # one entry of one B matrix of the default adapter moved: the policy is not the base any more
    with torch.no_grad():
        weight = next(p for n, p in tiny_policy.model.named_parameters() if "lora_B.default" in n)
        weight[0, 0] = 0.5
    tiny_policy.add_role("attacker")  # another role's adapter, still zero, does not stand for the active one
    assert not tiny_policy.adapter_is_zero()
    forwards.clear()
    policy_lp, reference_lp, _, mask = policy_entropy_reference_logprobs(tiny_policy, prompts, ids)
    hook.remove()
    assert len(forwards) == 2
    assert (sequence_kl(policy_lp, reference_lp, mask) > 0).any()
    with tiny_policy.role("attacker"):
        assert tiny_policy.adapter_is_zero()
