"""Group-relative advantages (GRPO: Shao et al. 2024, DeepSeekMath, section 4.1.2).

Departures from the paper, all named options: the division by the group's std is optional and off by
default (the reference system and Dr. GRPO use `r - mean(group)` only); rewards can be z-scored over the
whole batch first (the reference system does); every std is floored so that a group whose rewards are equal
up to rounding does not have its advantages multiplied by thousands. A missing or non-finite reward gets
advantage 0 and takes no part in its group's mean and std (TRL's rule for `None` rewards).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Rewards of one group whose std is below this are "all equal" (float32 rounding of values of order 1).
CONSTANT_GROUP_STD = 1e-6


@dataclass(frozen=True)
class AdvantageStats:
    """The batch statistics the advantages were computed from (the metrics registry, core/metrics/registry.py)."""

    n_invalid_rewards: int  # NaN, inf or missing rewards, given advantage 0
    n_degenerate_groups: int  # groups with < 2 valid rewards or a std below the floor: advantage 0
    reward_mean: float  # over the valid rewards; NaN when there is none
    reward_std: float  # sample std (n - 1) of the valid rewards: the batch z-score's divisor


def group_advantages(
    rewards_P_G: torch.Tensor,
    scale_by_group_std: bool = False,
    batch_zscore: bool = False,
    std_floor: float = 1e-2,
) -> tuple[torch.Tensor, AdvantageStats]:
    """Advantages [P, G] from rewards [P, G] (one row per prompt, one column per sample).

    >>> adv, stats = group_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    >>> adv.tolist(), stats.n_degenerate_groups
    ([[0.5, -0.5], [0.0, 0.0]], 1)
    """
    if rewards_P_G.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {tuple(rewards_P_G.shape)}")
    rewards = rewards_P_G.double()
    valid = torch.isfinite(rewards)
    zero = torch.zeros_like(rewards)
    n_valid_total = int(valid.sum())
    batch_mean = torch.where(valid, rewards, zero).sum() / max(n_valid_total, 1)
    batch_var = torch.where(valid, (rewards - batch_mean) ** 2, zero).sum() / max(n_valid_total - 1, 1)
    batch_std = batch_var.sqrt()
    if batch_zscore:
        rewards = (rewards - batch_mean) / batch_std.clamp(min=std_floor)

    n_valid_P = valid.sum(-1, keepdim=True)
    mean_P = torch.where(valid, rewards, zero).sum(-1, keepdim=True) / n_valid_P.clamp(min=1)
    centered = torch.where(valid, rewards - mean_P, zero)
    std_P = (centered.pow(2).sum(-1, keepdim=True) / (n_valid_P - 1).clamp(min=1)).sqrt()
    # A group is degenerate when nothing can be learned from it: fewer than two rewards, or all equal up to
    # rounding. Its advantages are exactly 0, not rounding noise (scaled up).
    degenerate_P = (n_valid_P < 2) | (std_P < CONSTANT_GROUP_STD)
    advantages = centered / std_P.clamp(min=std_floor) if scale_by_group_std else centered
    advantages = torch.where(valid & ~degenerate_P, advantages, zero)
    stats = AdvantageStats(
        n_invalid_rewards=int((~valid).sum()),
        n_degenerate_groups=int(degenerate_P.sum()),
        reward_mean=float(batch_mean) if n_valid_total else math.nan,
        reward_std=float(batch_std) if n_valid_total else math.nan,
    )
    return advantages.to(rewards_P_G.dtype if rewards_P_G.is_floating_point() else torch.float32), stats


def turn_advantages(
    returns_P_G_T: torch.Tensor,
    scale_by_group_std: bool = False,
    batch_zscore: bool = False,
    std_floor: float = 1e-2,
) -> torch.Tensor:
    """Per-turn advantages [P, G, T] of dialogues (dialogue.rewards=per_turn) from their turns' discounted returns
    [P, G, T]: turn t of a dialogue is compared with turn t of the other dialogues of its group (the same prompt,
    the same position in the dialogue), by `group_advantages`. A dialogue without rewards (NaN) gets 0 at every turn.

    >>> turn_advantages(torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])).tolist()
    [[[0.5, -1.0], [-0.5, 1.0]]]
    """
    if returns_P_G_T.dim() != 3:
        raise ValueError(f"returns must be [prompts, group, turns], got shape {tuple(returns_P_G_T.shape)}")
    per_turn = [
        group_advantages(returns_P_G_T[:, :, t], scale_by_group_std, batch_zscore, std_floor)[0]
        for t in range(returns_P_G_T.shape[2])
    ]
    return torch.stack(per_turn, dim=-1)
