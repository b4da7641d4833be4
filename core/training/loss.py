"""Policy-gradient losses of GRPO: one function per objective, each returning `(loss, LossStats)`.

Every loss has the signature `(logprobs_B_C, old_logprobs_B_C, advantages_B, weights_B_C, mask_B_C, ...)`:

- `logprobs_B_C`: log pi_theta(y_t) of the current forward, under the sampling distribution (temperature and
  suppressed ids applied, `core/tokens/logprobs.py`).
- `old_logprobs_B_C`: the denominator of the importance ratio r_t = pi_theta(y_t) / pi_old(y_t). By default
  the logprobs the sampler recorded when it drew y_t (never recomputed later), so on the first update after
  sampling r_t = 1 and the gradient is the plain policy gradient A * grad log pi. With truncated importance
  sampling they are the trainer's own logprobs at the sampling weights (see `mismatch_weights`).
- `advantages_B`: one group-relative advantage per sequence (GRPO, Shao et al. 2024); or [B, C], one per token
  (dialogues with per-turn rewards: each turn's tokens carry that turn's advantage). GSPO takes the first only.
- `weights_B_C`: per-token constants that carry the normalisation (`token_weights`) and, when on, the
  truncated importance-sampling factor. They sum over the *whole* batch, and each loss is a weighted *sum*
  over the micro-batch, so the gradient accumulated over micro-batches is exactly that of the whole batch.
- `mask_B_C`: true at completion tokens. Masked positions may hold -inf (suppressed ids at padding): they are
  selected away with `where`, never multiplied.

Variants, and where each departs from its paper:

- `importance_sampling_loss`: -sum_t w_t r_t A, unclipped (the reference system's `importance_sampling`).
- `ppo_clip_loss`: PPO's clipped surrogate, min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (Schulman et al.
  2017, eq. 7), with DAPO's separate upper range ("clip-higher", Yu et al. 2025); eps_low == eps_high is
  symmetric PPO. Departures: one advantage per sequence and no value function (GRPO); no dual clip.
- `gspo_loss`: GSPO (Zheng et al. 2025): one ratio per sequence, s_i = exp(mean_t log r_t), the geometric
  mean of its token ratios, clipped at the sequence level with its own ranges (paper: 3e-4 / 4e-4). The
  gradient is the paper's, s_i A_i * mean_t grad log pi(y_t). Departures: the paper averages sequences
  (1/G); here sequence i's term is weighted by the sum of its token weights, so `sequence` normalisation is
  the paper and `token` / `constant` weight a sequence by its length. The token-level variant (GSPO-token)
  is not implemented.

Normalisations (`token_weights`): `token` (DAPO, Yu et al. 2025), `sequence` (GRPO, Shao et al. 2024),
`constant` (Dr. GRPO, Liu et al. 2025: every token weighs 1 / (sequences x max_new_tokens), so neither the
length of a response nor the number of tokens in the batch rescales its gradient). Departure of `constant`
from Dr. GRPO: the sequence count is that of the update, after empty completions and (with dynamic sampling)
zero-advantage groups are left out.

Engine-mismatch corrections, for a sampler that is another engine (e.g. vLLM): its logprobs differ from the
trainer's at the same weights. The ratio is then taken against the trainer's logprobs at the sampling weights
(pi_old), and each token's term is multiplied by a detached factor of rho_t = pi_old(y_t) / pi_sampler(y_t)
(`mismatch_weights`), folded into `weights_B_C` so that it applies to every variant alike:

- `token_truncate`: min(rho_t, high) (truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", whose C = 2 is this project's default high). TRL's GRPOTrainer has
  the same formula as its `token_truncate` mode, with its own default cap of 3 (GRPOConfig's
  `vllm_importance_sampling_clip_max`, formerly `vllm_importance_sampling_cap`);
- `sequence_truncate`: one ratio per sequence, rho = prod_t rho_t, truncated to [low, high] and given to each of its
  tokens (TRL's `sequence_truncate`: no low bound, high = 3, TRL's default cap);
- `sequence_mask`: one ratio per sequence, rho = prod_t rho_t, given to each of its tokens, and 0 for a sequence
  whose rho is outside [low, high] (TRL's default mode `sequence_mask`: no low bound, high = 3);
- `icepop`: rho_t, and 0 for a token whose rho_t is outside [low, high] (IcePop, Ling Team 2025, "Every Step
  Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model": [0.5, 5]; TRL's `token_mask`).

For GSPO the factor is per token on the sequence's term; the papers do not combine the two.

`LossStats` holds sums over tokens, so the statistics of micro-batches add up exactly. The ratio statistics
are of the token ratio r_t for every variant, GSPO included (its sequence ratio is a function of them, and the
first-update check and the sampler KL are token-level quantities); `n_clipped` counts the tokens whose term
was clipped (for GSPO: every token of a clipped sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from redteam_grpo.core.training.kl import k3

Normalization = Literal["token", "sequence", "constant"]


@dataclass(frozen=True)
class LossStats:
    """Token statistics of the importance ratio r of one micro-batch, as sums: `a + b` is exactly the statistics
    of both. The sums are of r - 1 (not r), which keeps the variance exact when r is within 1e-7 of 1."""

    n_tokens: int = 0
    ratio_dev_sum: float = 0.0  # sum of (r - 1)
    ratio_dev_sq_sum: float = 0.0  # sum of (r - 1)^2
    ratio_abs_dev_sum: float = 0.0  # sum of |r - 1|
    ratio_max: float = -math.inf  # -inf for no tokens (the identity of max)
    k3_sum: float = 0.0  # sum of r - 1 - log r: k3 of KL(pi_old || pi_theta) (Schulman 2020), times n_tokens
    n_clipped: int = 0  # tokens whose term was clipped (no gradient through the ratio)

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            n_tokens=self.n_tokens + other.n_tokens,
            ratio_dev_sum=self.ratio_dev_sum + other.ratio_dev_sum,
            ratio_dev_sq_sum=self.ratio_dev_sq_sum + other.ratio_dev_sq_sum,
            ratio_abs_dev_sum=self.ratio_abs_dev_sum + other.ratio_abs_dev_sum,
            ratio_max=max(self.ratio_max, other.ratio_max),
            k3_sum=self.k3_sum + other.k3_sum,
            n_clipped=self.n_clipped + other.n_clipped,
        )

    def _per_token(self, total: float) -> float:
        return total / self.n_tokens if self.n_tokens else math.nan

    @property
    def ratio_mean(self) -> float:
        return 1.0 + self._per_token(self.ratio_dev_sum)

    @property
    def ratio_std(self) -> float:
        """Sample std (n - 1 in the denominator, floored at 1 as everywhere in the project); NaN for no tokens."""
        if not self.n_tokens:
            return math.nan
        squares = self.ratio_dev_sq_sum - self.ratio_dev_sum**2 / self.n_tokens
        return math.sqrt(max(squares, 0.0) / max(self.n_tokens - 1, 1))

    @property
    def ratio_abs_dev(self) -> float:
        """Mean |r - 1|."""
        return self._per_token(self.ratio_abs_dev_sum)

    @property
    def kl(self) -> float:
        """k3 estimate of KL(pi_old || pi_theta) per token, from tokens drawn from pi_old."""
        return self._per_token(self.k3_sum)

    @property
    def clip_fraction(self) -> float:
        return self._per_token(float(self.n_clipped))


def token_weights(
    mask_B_C: torch.Tensor,
    normalization: Normalization,
    n_tokens: int,
    n_sequences: int,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token weights of one micro-batch, normalised over the whole batch (not only this micro-batch).

    token: every completion token of the batch weighs 1 / n_tokens (DAPO's token-level mean); they sum to 1.
    sequence: each sequence weighs 1 / n_sequences, shared equally by its tokens (the GRPO paper); sum 1.
    constant: every token weighs 1 / (n_sequences * max_new_tokens) (Dr. GRPO); they sum to at most 1.
    """
    mask = mask_B_C.float()
    if normalization == "token":
        return mask / max(n_tokens, 1)
    if normalization == "sequence":
        lengths_B_1 = mask.sum(-1, keepdim=True).clamp(min=1)
        return mask / lengths_B_1 / max(n_sequences, 1)
    if normalization == "constant":
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError("constant normalisation divides by max_new_tokens: pass the sampler's max_new_tokens")
        return mask / (max(n_sequences, 1) * max_new_tokens)
    raise ValueError(f"unknown loss normalisation {normalization!r}: token, sequence or constant")


MismatchCorrection = Literal["token_truncate", "sequence_truncate", "sequence_mask", "icepop"]


def mismatch_weights(
    trainer_logprobs_B_C: torch.Tensor,
    sampler_logprobs_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
    method: MismatchCorrection,
    low: float | None,
    high: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine-mismatch factor of each token (detached, 1 outside the mask) and where the correction acted (the
    tokens truncated or masked: a bool [B, C]).

    `trainer_logprobs_B_C` are the trainer's logprobs at the weights the sampler used: on every update of a batch
    the same ones (those of its first forward), never recomputed from the updated weights. Bounds are compared and
    applied in log space, so a sequence ratio that would overflow exp is still masked or truncated exactly.

    The sequence methods follow TRL's GRPOTrainer (`vllm_importance_sampling_mode`): rho = exp(sum_t of the masked
    log-ratios), one per sequence; `sequence_truncate` is clamp(rho, low, high), `sequence_mask` rho with 0 outside
    [low, high]. Here the clamp is of the summed log-ratio, so exp never overflows (TRL's exp(1000) is inf before its
    clamp). A sequence method marks every trained token of a sequence whose rho crossed a bound.
    """
    log_rho_B_C = _log_ratio(trainer_logprobs_B_C, sampler_logprobs_B_C, mask_B_C).detach()
    if method in ("sequence_truncate", "sequence_mask"):  # one ratio per sequence: the product of its tokens'
        log_rho_B_C = log_rho_B_C.sum(-1, keepdim=True).expand_as(log_rho_B_C)  # (padding holds 0)
    log_low = -math.inf if low is None else math.log(low)
    log_high = math.inf if high is None else math.log(high)
    outside_B_C = ((log_rho_B_C < log_low) | (log_rho_B_C > log_high)) & mask_B_C
    if method in ("token_truncate", "sequence_truncate"):
        weights_B_C = torch.exp(log_rho_B_C.clamp(min=log_low, max=log_high))
    elif method in ("sequence_mask", "icepop"):
        weights_B_C = torch.where(outside_B_C, 0.0, torch.exp(log_rho_B_C.clamp(max=log_high)))
    else:
        raise ValueError(
            f"unknown mismatch correction {method!r}: token_truncate, sequence_truncate, sequence_mask or icepop"
        )
    return torch.where(mask_B_C, weights_B_C, 1.0), outside_B_C


def ratio_stats(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
    clipped_B_C: torch.Tensor | None = None,
) -> LossStats:
    """Statistics of r = exp(logprobs - old_logprobs) over the masked tokens."""
    log_ratio_B_C = _log_ratio(logprobs_B_C, old_logprobs_B_C, mask_B_C)
    return _stats(log_ratio_B_C, mask_B_C, torch.zeros_like(mask_B_C) if clipped_B_C is None else clipped_B_C)


def _stats(log_ratio_B_C: torch.Tensor, mask_B_C: torch.Tensor, clipped_B_C: torch.Tensor) -> LossStats:
    log_ratio = log_ratio_B_C.detach()[mask_B_C].double()
    if not log_ratio.numel():
        return LossStats()
    dev = torch.expm1(log_ratio)  # r - 1, exact near r = 1
    return LossStats(
        n_tokens=log_ratio.numel(),
        ratio_dev_sum=float(dev.sum()),
        ratio_dev_sq_sum=float(dev.square().sum()),
        ratio_abs_dev_sum=float(dev.abs().sum()),
        ratio_max=float(dev.max()) + 1.0,
        k3_sum=float(k3(log_ratio).sum()),
        n_clipped=int((clipped_B_C & mask_B_C).sum()),
    )


def _log_ratio(logprobs_B_C: torch.Tensor, old_logprobs_B_C: torch.Tensor, mask_B_C: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_B_C, logprobs_B_C - old_logprobs_B_C, torch.zeros_like(logprobs_B_C))


def _weighted_loss(objective_B_C: torch.Tensor, weights_B_C: torch.Tensor, mask_B_C: torch.Tensor) -> torch.Tensor:
    return -(torch.where(mask_B_C, objective_B_C, torch.zeros_like(objective_B_C)) * weights_B_C).sum()


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages that broadcast over [B, C]: [B] (one per sequence) as [B, 1]; [B, C] (one per token) as is."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1)
    if advantages.dim() == 2:
        return advantages
    raise ValueError(f"advantages must be [B] or [B, C], got shape {tuple(advantages.shape)}")


def _clipped_surrogate(
    ratio_B_C: torch.Tensor, advantages_B: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and where the clipped term won (no gradient there)."""
    adv_B_1 = _per_token(advantages_B)
    unclipped_B_C = ratio_B_C * adv_B_1
    clipped_B_C = ratio_B_C.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv_B_1
    return torch.minimum(unclipped_B_C, clipped_B_C), clipped_B_C < unclipped_B_C


def importance_sampling_loss(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    weights_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
) -> tuple[torch.Tensor, LossStats]:
    """Unclipped importance-sampling policy gradient: -sum_t w_t r_t A (the reference system's default).

    On-policy (r = 1) its gradient is REINFORCE with a group baseline (Williams 1992; Shao et al. 2024).
    """
    log_ratio_B_C = _log_ratio(logprobs_B_C, old_logprobs_B_C, mask_B_C)
    objective_B_C = torch.exp(log_ratio_B_C) * _per_token(advantages_B)
    loss = _weighted_loss(objective_B_C, weights_B_C, mask_B_C)
    return loss, _stats(log_ratio_B_C, mask_B_C, torch.zeros_like(mask_B_C))


def ppo_clip_loss(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    weights_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, LossStats]:
    """PPO's clipped surrogate per token, -sum_t w_t min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, with the upper range decoupled
    from the lower (DAPO's clip-higher, Yu et al. 2025: 0.2 / 0.28), so that low-probability tokens with a
    positive advantage can grow further before their gradient is cut. eps_low == eps_high is symmetric PPO.
    """
    log_ratio_B_C = _log_ratio(logprobs_B_C, old_logprobs_B_C, mask_B_C)
    objective_B_C, clipped_B_C = _clipped_surrogate(torch.exp(log_ratio_B_C), advantages_B, epsilon_low, epsilon_high)
    loss = _weighted_loss(objective_B_C, weights_B_C, mask_B_C)
    return loss, _stats(log_ratio_B_C, mask_B_C, clipped_B_C)


def gspo_loss(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    weights_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, LossStats]:
    """GSPO's sequence-level clipped objective (Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7).

    s_i = exp(mean_t log r_t) over sequence i's tokens; its term min(s_i A_i, clip(s_i, 1 - eps_low,
    1 + eps_high) A_i) is given to each of its tokens, so the loss is -sum_i (sum_t w_t) term_i and its
    gradient, where not clipped, is -sum_i (sum_t w_t) s_i A_i mean_t grad log pi(y_t) (the paper's eq. 10).
    Paper ranges: 3e-4 / 4e-4 (section 5.1); with `sequence` normalisation the weighting is the paper's.
    """
    if advantages_B.dim() != 1:
        raise ValueError("GSPO takes one advantage per sequence: per-token advantages (per-turn rewards) do not apply")
    log_ratio_B_C = _log_ratio(logprobs_B_C, old_logprobs_B_C, mask_B_C)
    lengths_B_1 = mask_B_C.sum(-1, keepdim=True).clamp(min=1)
    log_ratio_B_1 = log_ratio_B_C.sum(-1, keepdim=True) / lengths_B_1  # padding holds 0: a masked mean
    ratio_B_C = torch.exp(log_ratio_B_1).expand_as(log_ratio_B_C)  # one ratio per sequence
    objective_B_C, clipped_B_C = _clipped_surrogate(ratio_B_C, advantages_B, epsilon_low, epsilon_high)
    loss = _weighted_loss(objective_B_C, weights_B_C, mask_B_C)
    return loss, _stats(log_ratio_B_C, mask_B_C, clipped_B_C)
