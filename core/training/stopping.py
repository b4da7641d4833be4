"""Early stopping: decided from an iteration's metrics row, recorded with a machine-readable kind.

The kind, not the message, is what other code reads (a lineage continues only from runs that finished or
reached their reward target); the message is for people and may be reworded freely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from redteam_grpo.core.config import RunConfig

REWARD_TARGET = "reward_target"  # the mean reward passed run.early_stop_reward: the attack works
REPETITION = "repetition"  # the mean repetition ratio passed run.early_stop_repetition: the policy collapsed
StopKind = Literal["reward_target", "repetition"]


@dataclass(frozen=True)
class StopDecision:
    kind: StopKind
    message: str


def early_stop(metrics: Mapping[str, float], cfg: RunConfig) -> StopDecision | None:
    """Whether a run should stop after the iteration with these metrics, and why.

    >>> early_stop({"reward_mean": 0.9, "repetition_mean": 0.1}, RunConfig()).kind
    'reward_target'
    >>> early_stop({"reward_mean": 0.2, "repetition_mean": 0.1}, RunConfig()) is None
    True
    """
    if cfg.early_stop_reward is not None and metrics["reward_mean"] > cfg.early_stop_reward:
        return StopDecision(
            REWARD_TARGET, f"mean reward {metrics['reward_mean']:.3f} > run.early_stop_reward {cfg.early_stop_reward}"
        )
    if cfg.early_stop_repetition is not None and metrics["repetition_mean"] > cfg.early_stop_repetition:
        return StopDecision(
            REPETITION,
            f"mean repetition ratio {metrics['repetition_mean']:.3f} > run.early_stop_repetition "
            f"{cfg.early_stop_repetition}",
        )
    return None
