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


def logit_noise_scale(logprobs_B_C_V: torch.Tensor, head_row_norms_V: torch.Tensor | None = None) -> torch.Tensor:
    """The squared scale of each position's logits that rounding noise is proportional to: [B, C]. Their variance
    over the vocabulary (that of the logprobs, which differ by a constant; suppressed tokens, at -inf, left out),
    reweighted to the tokens the distribution draws: times the mean squared LM-head row norm under the distribution
    over its mean over the vocabulary (`head_row_norms_V`: squared row norms; None: rows of one norm). A logit is a
    row times the last hidden state, so its rounding noise is that row's norm times the state's: where the drawn
    tokens' rows are larger than the vocabulary's (a random model whose unused rows are zero), so is the noise.

    >>> logit_noise_scale(torch.tensor([[[0.0, 2.0, float("-inf")]]]))
    tensor([[1.]])
    >>> lp = torch.tensor([[[0.0, -50.0, -50.0]]])  # all mass on a row with 3x the mean squared norm
    >>> logit_noise_scale(lp, torch.tensor([3.0, 0.0, 0.0])) / logit_noise_scale(lp)
    tensor([[3.]])
    """
    finite = torch.isfinite(logprobs_B_C_V)
    count = finite.sum(-1).clamp(min=1)
    zero = torch.zeros((), device=logprobs_B_C_V.device)
    values = torch.where(finite, logprobs_B_C_V.float(), zero)
    mean = values.sum(-1, keepdim=True) / count.unsqueeze(-1)
    variance_B_C = torch.where(finite, (values - mean) ** 2, zero).sum(-1) / count
    if head_row_norms_V is None:
        return variance_B_C
    norms_V = head_row_norms_V.to(device=values.device, dtype=torch.float32)
    drawn_B_C = (logprobs_B_C_V.float().exp() @ norms_V) / norms_V.mean().clamp(min=torch.finfo(torch.float32).tiny)
    return variance_B_C * drawn_B_C


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
