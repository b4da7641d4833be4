import doctest
import math

import redteam_grpo.core.advantages
import redteam_grpo.core.rewards
from redteam_grpo.core.rewards import composite_reward, repetition_ratio


def test_doctests():
    for module in (redteam_grpo.core.rewards, redteam_grpo.core.advantages):
        assert doctest.testmod(module).failed == 0


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
    assert math.isnan(composite_reward(None, 0.0, 0.0, 1.0, 0.3, 0.1))
    assert math.isnan(composite_reward(float("nan"), 0.0, 0.0, 1.0, 0.3, 0.1))
