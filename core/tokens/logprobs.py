"""The distribution tokens are sampled from, applied identically by the sampler and the trainer.

The sampler (core/rollouts/sampling.py) draws each token itself from `SamplingDistribution.process` applied to the
model's own logits of that step, and records `log_softmax` of it at the drawn token; the trainer applies the same
function to its own forward's logits. The importance ratio is therefore 1 on the first update up to the rounding of two
kernels (the first-update check in core/training/train.py bounds it), and no transformation `generate` adds on its own
(a hidden top-k from a generation config) can change the distribution: the sampler checks that `generate` kept every
token it drew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingDistribution:
    temperature: float
    suppressed_ids: tuple[int, ...] = ()  # tokens the policy may never draw (pad, turn headers)

    def process(self, logits_N_V: torch.Tensor) -> torch.Tensor:
        """Logits of the sampling distribution: suppressed tokens at -inf, divided by the temperature."""
        logits = logits_N_V.float()
        if self.suppressed_ids:
            logits = logits.index_fill(-1, torch.tensor(self.suppressed_ids, device=logits.device), float("-inf"))
        return logits / self.temperature

    def logprobs(self, logits_N_V: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.process(logits_N_V), dim=-1)


def token_logprobs(logprobs_B_C_V: torch.Tensor, token_ids_B_C: torch.Tensor) -> torch.Tensor:
    """log p(token) at each position: [B, C]."""
    return torch.gather(logprobs_B_C_V, -1, token_ids_B_C.unsqueeze(-1)).squeeze(-1)


def entropy(logprobs_B_C_V: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution, -sum p log p, with 0 * -inf taken as 0: [B, C]."""
    probs = logprobs_B_C_V.exp()
    return -torch.where(probs > 0, probs * logprobs_B_C_V, torch.zeros_like(probs)).sum(-1)


def varentropy(logprobs_B_C_V: torch.Tensor) -> torch.Tensor:
    """The variance of the surprisal under each position's distribution, Var_{v~p}(log p_v), with 0 * -inf taken as
    0: [B, C]. log p is the processed logits less a constant, so this is the p-weighted variance of the logits the
    tokens are drawn from: what a perturbation of the logits changes the distribution by, to second order
    (KL(p || p') = 1/2 Var_{v~p}(dz) for logits z' = z + dz). It shrinks as the distribution peaks: 0 on one token.

    >>> varentropy(torch.tensor([[[0.0, float("-inf")]]]))  # all mass on one token
    tensor([[0.]])
    >>> varentropy(torch.log(torch.tensor([[[0.5, 0.25, 0.25]]])))  # surprisals 1, 2, 2 bits: Var 0.25 bit^2
    tensor([[0.1201]])
    """
    probs = logprobs_B_C_V.exp()
    surprisal = torch.where(probs > 0, -logprobs_B_C_V, torch.zeros_like(probs))
    mean_B_C = (probs * surprisal).sum(-1)
    return ((probs * surprisal.square()).sum(-1) - mean_B_C.square()).clamp(min=0.0)


def logit_second_moment(logits_B_C_V: torch.Tensor, logprobs_B_C_V: torch.Tensor) -> torch.Tensor:
    """E_{v~p}[z_v^2] of each position's processed logits z (the model's raw logits over the temperature; suppressed
    tokens, at -inf, have p = 0), p = exp(`logprobs_B_C_V`), their log-softmax: [B, C]. Not shift-invariant, as
    bfloat16 rounding is not: a logit's rounding error is relative to its magnitude, so large logits on the drawn tokens
    round coarsely.

    >>> z = torch.tensor([[[3.0, float("-inf")]]])
    >>> logit_second_moment(z, torch.log_softmax(z, -1))
    tensor([[9.]])
    """
    finite = torch.isfinite(logits_B_C_V)
    values = torch.where(finite, logits_B_C_V.float(), torch.zeros((), device=logits_B_C_V.device))
    return (logprobs_B_C_V.float().exp() * values.square()).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is true. Uses `where`, not multiplication: masked values may be -inf."""
    zeroed = torch.where(mask, values, torch.zeros_like(values))
    if dim is None:
        return zeroed.sum() / mask.sum().clamp(min=1)
    return zeroed.sum(dim) / mask.sum(dim).clamp(min=1)


def pad_ragged(rows: Sequence[Sequence[float]], width: int, value: float = 0.0) -> torch.Tensor:
    """A [len(rows), width] float tensor from ragged rows."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(list(row), dtype=torch.float32)
    return out
