"""KL(policy_T || reference_T) per completion token, for the distribution the tokens were drawn from.

The sampler draws from `policy.distribution` applied to the policy's logits: temperature T, and the
suppressed ids (pad, turn headers) at -inf. Both sides of the KL go through that same processing: the policy
(adapter on) and the reference (the same model, adapter off: `Policy.reference`). The estimate is therefore
of KL(pi_T || pi_ref,T), where pi_T = softmax(suppress(logits) / T), at every temperature.

Estimator: k3 = exp(r) - r - 1 with r = log pi_ref,T(y) - log pi_T(y) at the sampled token y (J. Schulman,
"Approximating KL Divergence", 2020). Since y ~ pi_T given its prefix, k3 is unbiased for the full-vocabulary
KL at that position, never negative, and exactly 0 where the two logprobs are equal. Untempered logprobs at
tempered samples would estimate no KL at all at T != 1 (their expectation under pi_T is not a divergence
between the distributions they come from). `sequence_kl` is the mean over a completion's tokens: the
per-token average of the per-position KLs, whose sum is the KL of the whole completion.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from redteam_grpo.core.models.policy import Policy, completion_logits, span_logits
from redteam_grpo.core.tokens.logprobs import entropy, masked_mean, token_logprobs


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = exp(r) - 1 - r of each log-ratio r = log q(y) - log p(y) at a token y drawn from p: an unbiased,
    never-negative estimate of KL(p || q) at that position, 0 where the two agree. The one place it is written: the
    reward's KL term, the update's KL(old || new) statistic and the first update's gates call it."""
    return torch.expm1(log_ratio) - log_ratio


def k3_kl(policy_logprobs_B_C: torch.Tensor, reference_logprobs_B_C: torch.Tensor, mask_B_C: torch.Tensor):
    """Per-token k3 estimate of KL(policy || reference), 0 outside the mask: [B, C]."""
    log_ratio = torch.where(
        mask_B_C,
        reference_logprobs_B_C - policy_logprobs_B_C,
        torch.zeros_like(mask_B_C, dtype=torch.float32),
    )
    return torch.where(mask_B_C, k3(log_ratio), torch.zeros_like(log_ratio))


def sequence_kl(policy_logprobs_B_C: torch.Tensor, reference_logprobs_B_C: torch.Tensor, mask_B_C: torch.Tensor):
    """Mean per-token KL of each completion: [B]."""
    return masked_mean(k3_kl(policy_logprobs_B_C, reference_logprobs_B_C, mask_B_C), mask_B_C, dim=-1)


Spans = Sequence[Sequence[tuple[int, int]]] | None


def _logits(policy: Policy, prompt_ids, completion_ids, spans: Spans):
    """The completions' logits, or with `spans` those of the spans of prompt + completion (a dialogue speaker's own
    turns, core/rollouts/dialogue.py)."""
    if spans is None:
        return completion_logits(policy, prompt_ids, completion_ids)
    return span_logits(policy, [[*p, *c] for p, c in zip(prompt_ids, completion_ids, strict=True)], spans)


def _sampled_logprobs(
    policy: Policy, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], spans: Spans = None
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_B_C_V, ids_B_C, mask_B_C = _logits(policy, prompt_ids, completion_ids, spans)
    return token_logprobs(policy.distribution.logprobs(logits_B_C_V), ids_B_C), mask_B_C


@torch.no_grad()
def reference_logprobs(
    policy: Policy, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], spans: Spans = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_ref,T(y) of every completion token (adapters off, the sampling distribution) and the mask: [B, C] on the
    CPU. The one place the reference side is computed; alone, for a caller that has the policy's side from the
    sampler. `spans`: the tokens of those spans of prompt + completion instead (a dialogue speaker's own turns)."""
    with policy.reference():
        reference_lp_B_C, mask_B_C = _sampled_logprobs(policy, prompt_ids, completion_ids, spans)
    return reference_lp_B_C.cpu(), mask_B_C.cpu()


@torch.no_grad()
def policy_entropy_reference_logprobs(
    policy: Policy, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], spans: Spans = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `policy_reference_logprobs`, plus the policy's entropy at every completion position [B, C] (on the same
    sampling distribution): the defense reward's entropy term, from the same forward. Where the active adapter is
    zero (a run's first iteration) the policy is the base: one forward gives both sides, equal bit for bit as the
    second forward would give them, and the KL is exactly 0."""
    logits_B_C_V, ids_B_C, mask_B_C = _logits(policy, prompt_ids, completion_ids, spans)
    logprobs_B_C_V = policy.distribution.logprobs(logits_B_C_V)
    policy_lp_B_C, entropy_B_C = token_logprobs(logprobs_B_C_V, ids_B_C), entropy(logprobs_B_C_V)
    if policy.adapter_is_zero():
        return policy_lp_B_C.cpu(), policy_lp_B_C.cpu().clone(), entropy_B_C.cpu(), mask_B_C.cpu()
    reference_lp_B_C, _ = reference_logprobs(policy, prompt_ids, completion_ids, spans)
    return policy_lp_B_C.cpu(), reference_lp_B_C, entropy_B_C.cpu(), mask_B_C.cpu()


@torch.no_grad()
def policy_reference_logprobs(
    policy: Policy, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log pi_T(y) and log pi_ref,T(y) of every completion token, both under the sampling distribution
    (temperature and suppressed ids of `policy.distribution`), and the completion mask: three [B, C] on the CPU.
    Masked positions may hold -inf."""
    policy_lp_B_C, mask_B_C = _sampled_logprobs(policy, prompt_ids, completion_ids)
    reference_lp_B_C, _ = reference_logprobs(policy, prompt_ids, completion_ids)
    return policy_lp_B_C.cpu(), reference_lp_B_C, mask_B_C.cpu()
