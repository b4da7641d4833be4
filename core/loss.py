"""Importance-sampling policy-gradient losses.

loss = -sum_t w_t * ratio_t * A,  ratio_t = exp(log pi_theta(y_t) - log pi_sample(y_t))

`pi_sample` is the logprob recorded when the token was drawn (seed 001, bug 5: never recomputed later), so
on the first update after sampling the ratio is 1 and the gradient is the plain policy gradient A * grad log pi.
The token weights `w` carry the normalisation (see `token_weights`), which keeps the loss exact when a batch
is split into micro-batches. Each variant is its own function and returns `(loss, LossStats)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class LossStats:
    ratio_mean: torch.Tensor
    ratio_std: torch.Tensor
    ratio_max: torch.Tensor
    clip_fraction: torch.Tensor
    n_tokens: torch.Tensor


def token_weights(
    mask_B_C: torch.Tensor, normalization: Literal["token", "sequence"], n_tokens: int, n_sequences: int
) -> torch.Tensor:
    """Per-token weights that sum to 1 over the whole batch (not only this micro-batch).

    token: every completion token of the batch weighs 1 / n_tokens (DAPO's token-level mean).
    sequence: each sequence weighs 1 / n_sequences, shared equally by its tokens (the GRPO paper's mean).
    """
    mask = mask_B_C.float()
    if normalization == "token":
        return mask / max(n_tokens, 1)
    lengths_B = mask.sum(-1, keepdim=True).clamp(min=1)
    return mask / lengths_B / max(n_sequences, 1)


def _ratio_stats(ratio_B_C: torch.Tensor, mask_B_C: torch.Tensor, clipped_B_C: torch.Tensor) -> LossStats:
    values = ratio_B_C.detach()[mask_B_C]
    n = values.numel()
    return LossStats(
        ratio_mean=values.mean() if n else torch.tensor(1.0),
        ratio_std=values.std(unbiased=False) if n else torch.tensor(0.0),
        ratio_max=values.max() if n else torch.tensor(1.0),
        clip_fraction=clipped_B_C[mask_B_C].float().mean() if n else torch.tensor(0.0),
        n_tokens=torch.tensor(n),
    )


def _log_ratio(logprobs_B_C, sample_logprobs_B_C, mask_B_C):
    # Masked positions may hold -inf (suppressed tokens at padding): select, never multiply.
    return torch.where(mask_B_C, logprobs_B_C - sample_logprobs_B_C, torch.zeros_like(logprobs_B_C))


def importance_sampling_loss(
    logprobs_B_C: torch.Tensor,
    sample_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    weights_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
) -> tuple[torch.Tensor, LossStats]:
    """Unclipped importance-sampling policy gradient (the reference system's `importance_sampling` loss)."""
    ratio_B_C = torch.exp(_log_ratio(logprobs_B_C, sample_logprobs_B_C, mask_B_C))
    objective_B_C = ratio_B_C * advantages_B.unsqueeze(-1)
    loss = -(torch.where(mask_B_C, objective_B_C, torch.zeros_like(objective_B_C)) * weights_B_C).sum()
    return loss, _ratio_stats(ratio_B_C, mask_B_C, torch.zeros_like(mask_B_C))


def clipped_importance_sampling_loss(
    logprobs_B_C: torch.Tensor,
    sample_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    weights_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
    clip_epsilon: float,
) -> tuple[torch.Tensor, LossStats]:
    """PPO's clipped surrogate, min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) (Schulman et al. 2017, eq. 7)."""
    ratio_B_C = torch.exp(_log_ratio(logprobs_B_C, sample_logprobs_B_C, mask_B_C))
    adv_B_1 = advantages_B.unsqueeze(-1)
    unclipped = ratio_B_C * adv_B_1
    clipped = ratio_B_C.clamp(1.0 - clip_epsilon, 1.0 + clip_epsilon) * adv_B_1
    objective_B_C = torch.minimum(unclipped, clipped)
    loss = -(torch.where(mask_B_C, objective_B_C, torch.zeros_like(objective_B_C)) * weights_B_C).sum()
    return loss, _ratio_stats(ratio_B_C, mask_B_C, clipped < unclipped)
