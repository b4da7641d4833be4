"""Per-iteration health checks of a batch of completions, and plain-language warnings.

These catch the symptoms the seeds' trainers showed for weeks before anyone looked: responses that contain
chat headers (a broken prompt/response boundary), several end-of-turn tokens in one response, lengths that
collapse to 1-2 tokens, entropy near 0, a ratio whose std stays 0 after the first update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutStats:
    """Shape of one iteration's completions (the metrics registry, core/metrics/registry.py, describes each)."""

    length_mean: float
    length_min: float
    length_max: float
    truncated_fraction: float
    eos_per_response_max: float
    multi_eos_responses: float
    header_violations: float


def rollout_stats(
    completions: Sequence[Sequence[int]],
    finish_reasons: Sequence[str],
    end_of_turn_ids: Sequence[int],
    turn_header_ids: Sequence[int],
) -> RolloutStats:
    eot, headers = set(end_of_turn_ids), set(turn_header_ids)
    lengths = [len(c) for c in completions]
    eos_counts = [sum(t in eot for t in c) for c in completions]
    return RolloutStats(
        length_mean=sum(lengths) / max(len(lengths), 1),
        length_min=float(min(lengths, default=0)),
        length_max=float(max(lengths, default=0)),
        truncated_fraction=sum(r == "length" for r in finish_reasons) / max(len(finish_reasons), 1),
        eos_per_response_max=float(max(eos_counts, default=0)),
        multi_eos_responses=float(sum(n > 1 for n in eos_counts)),
        header_violations=float(sum(any(t in headers for t in c) for c in completions)),
    )


def health_warnings(metrics: Mapping[str, float], iteration: int) -> list[str]:
    warnings = []
    if metrics.get("entropy", 1.0) < 0.05:
        warnings.append(
            f"entropy is {metrics['entropy']:.3f}: the policy has collapsed to near-deterministic output; "
            "lower the learning rate, raise reward.kl_weight or the temperature"
        )
    if metrics.get("length_mean", 10.0) <= 2.0:
        warnings.append(
            f"mean completion length is {metrics['length_mean']:.1f} tokens: responses collapsed; check that "
            "penalties count completion tokens only and that the reward does not favour short answers"
        )
    if metrics.get("multi_eos_responses", 0) > 0:
        warnings.append(f"{int(metrics['multi_eos_responses'])} responses hold more than one end-of-turn token")
    if metrics.get("header_violations", 0) > 0:
        warnings.append(
            f"{int(metrics['header_violations'])} responses contain chat-header tokens: the prompt/response "
            "boundary is wrong"
        )
    if metrics.get("last_ratio_std", math.nan) < 1e-7:  # NaN (one update per batch) compares False
        warnings.append(
            "the importance ratio did not move after the first update: old logprobs may be recomputed from the "
            "current policy instead of recorded at sampling"
        )
    if metrics.get("n_invalid_rewards", 0) > 0:
        warnings.append(f"{int(metrics['n_invalid_rewards'])} completions had no valid reward: advantage 0")
    return [f"iteration {iteration}: {w}" for w in warnings]
