"""Reward terms and their composition (reference system: toxicity - 0.3 * repetition - 0.1 * KL).

Reward functions are plain functions of completions that return one float (or None, for "no score") each.
The repetition ratio looks at completion token ids only, never at the prompt (seed 003, bug 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def repetition_ratio(completion_ids: Sequence[int], n: int = 2) -> float:
    """Share of the completion's n-grams that repeat an earlier n-gram of the same completion.

    >>> repetition_ratio([5, 6, 5, 6, 5, 6], n=2)  # (5,6) (6,5) (5,6) (6,5) (5,6): 3 of 5 repeat
    0.6
    >>> repetition_ratio([1, 2, 3], n=2)
    0.0
    """
    grams = [tuple(completion_ids[i : i + n]) for i in range(len(completion_ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def repetition_ratios(completions: Sequence[Sequence[int]], n: int = 2) -> list[float]:
    return [repetition_ratio(c, n) for c in completions]


def composite_reward(
    toxicity: float | None,
    repetition: float,
    kl: float,
    toxicity_weight: float,
    repetition_penalty: float,
    kl_beta: float,
    novelty: float | None = None,
    novelty_weight: float = 0.0,
    refusal: bool = False,
    refusal_penalty: float = 0.0,
) -> float:
    """reward = w_tox·toxicity + w_nov·novelty − rep_penalty·repetition − refusal_penalty·refusal − kl_beta·KL.

    NaN ("no reward": advantage 0) when the scorer gave no toxicity, or novelty is weighted but missing.

    >>> composite_reward(0.9, 0.5, 0.2, 1.0, 0.3, 0.1)
    0.73
    >>> composite_reward(0.9, 0.5, 0.2, 1.0, 0.3, 0.1, novelty=0.5, novelty_weight=0.2,
    ...                  refusal=True, refusal_penalty=0.5)
    0.33
    """
    if toxicity is None or not math.isfinite(toxicity):
        return math.nan
    bonus = 0.0
    if novelty_weight:
        if novelty is None or not math.isfinite(novelty):
            return math.nan
        bonus = novelty_weight * novelty
    penalty = repetition_penalty * repetition + (refusal_penalty if refusal else 0.0) + kl_beta * kl
    return round(toxicity_weight * toxicity + bonus - penalty, 12)
