import math

import pytest

from redteam_grpo.core.training.rewards import RewardTerms, RewardWeights, composite_reward, repetition_ratio


def test_repetition_counts_only_the_tokens_it_is_given():
    prompt = [7, 7, 7, 7, 7, 7]
    completion = [1, 2, 3, 4]
    # The prompt is heavily repetitive; the completion is not. Only the completion may be scored.
    assert repetition_ratio(completion, 2) == 0.0
    assert repetition_ratio(prompt + completion, 2) > 0.4


def test_spam_has_high_repetition():
    assert repetition_ratio([5] * 10, 1) == 0.9
    assert repetition_ratio([5], 2) == 0.0


def test_composite_reward_is_nan_without_a_score():
    assert math.isnan(composite_reward(RewardTerms(None, 0.0, 0.0), RewardWeights()))
    assert math.isnan(composite_reward(RewardTerms(float("nan"), 0.0, 0.0), RewardWeights()))


@pytest.mark.parametrize(
    ("terms", "weights", "expected"),
    [
        # 1.0·0.8 − 0.3·0.2 − 0.1·0.5 = 0.8 − 0.06 − 0.05
        (RewardTerms(harm=0.8, repetition=0.2, kl=0.5), RewardWeights(), 0.69),
        # + 0.4·0.5 novelty = 0.69 + 0.2
        (RewardTerms(0.8, 0.2, 0.5, novelty=0.5), RewardWeights(novelty=0.4), 0.89),
        # − 0.7 for a refusal = 0.69 − 0.7
        (RewardTerms(0.8, 0.2, 0.5, refusal=True), RewardWeights(refusal=0.7), -0.01),
        # a refusal with weight 0 is counted, not penalised
        (RewardTerms(0.8, 0.2, 0.5, refusal=True), RewardWeights(), 0.69),
        # weights 2 / 0.5 / 1: 2·0.25 − 0.5·0.4 − 1·0.1 = 0.5 − 0.2 − 0.1
        (RewardTerms(0.25, 0.4, 0.1), RewardWeights(harm=2.0, repetition=0.5, kl=1.0), 0.2),
        # novelty off: a missing novelty does not matter
        (RewardTerms(0.8, 0.2, 0.5, novelty=None), RewardWeights(novelty=0.0), 0.69),
    ],
)
def test_composite_reward_matches_hand_worked_numbers(terms, weights, expected):
    assert composite_reward(terms, weights) == pytest.approx(expected, abs=1e-12)


def test_a_weighted_novelty_that_is_missing_gives_no_reward():
    assert math.isnan(composite_reward(RewardTerms(0.8, 0.2, 0.5, novelty=None), RewardWeights(novelty=0.4)))
