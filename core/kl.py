"""KL(policy || reference) per completion token.

Both sides use untempered logits (the models' own distributions), whatever the sampling temperature, so the
KL compares like with like. Estimator: k3 = exp(r) - r - 1 with r = log pi_ref - log pi_theta at the sampled
token (J. Schulman, "Approximating KL Divergence", 2020): unbiased for samples from pi_theta, never negative,
and exactly 0 where the two logprobs are equal.
"""

from __future__ import annotations

import torch

from redteam_grpo.core.logprobs import masked_mean


def k3_kl(policy_logprobs_B_C: torch.Tensor, reference_logprobs_B_C: torch.Tensor, mask_B_C: torch.Tensor):
    """Per-token k3 estimate, 0 outside the mask: [B, C]."""
    log_ratio = torch.where(
        mask_B_C,
        reference_logprobs_B_C - policy_logprobs_B_C,
        torch.zeros_like(mask_B_C, dtype=torch.float32),
    )
    return torch.where(mask_B_C, torch.expm1(log_ratio) - log_ratio, torch.zeros_like(log_ratio))


def sequence_kl(policy_logprobs_B_C: torch.Tensor, reference_logprobs_B_C: torch.Tensor, mask_B_C: torch.Tensor):
    """Mean per-token KL of each completion: [B]."""
    return masked_mean(k3_kl(policy_logprobs_B_C, reference_logprobs_B_C, mask_B_C), mask_B_C, dim=-1)
