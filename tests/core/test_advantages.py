import math

import torch

from redteam_grpo.core.training.advantages import group_advantages


def test_advantage_is_reward_minus_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.4, 0.6, 0.8]])
    adv, stats = group_advantages(rewards)
    # group 0 mean 0.5 -> [0.5, -0.5, 0, 0]; group 1 mean 0.5 -> [-0.3, -0.1, 0.1, 0.3]
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, 0.0, 0.0], [-0.3, -0.1, 0.1, 0.3]]))
    assert stats.n_invalid_rewards == 0 and stats.n_degenerate_groups == 0


def test_loop_and_vectorised_agree_with_group_std_scaling():
    rewards = torch.rand(5, 7, generator=torch.Generator().manual_seed(1))
    adv, _ = group_advantages(rewards, scale_by_group_std=True, std_floor=1e-4)
    for p in range(5):
        row = rewards[p].tolist()
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        expected = [(r - mean) / std for r in row]
        torch.testing.assert_close(adv[p], torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_all_equal_group_gives_zero_advantage_not_nan():
    adv, stats = group_advantages(torch.full((2, 4), 0.7), scale_by_group_std=True)
    assert torch.equal(adv, torch.zeros(2, 4))
    assert stats.n_degenerate_groups == 2


def test_rewards_equal_up_to_rounding_are_not_blown_up_by_std_scaling():
    rewards = torch.tensor([[0.5, 0.5 + 1e-7, 0.5 - 1e-7, 0.5]], dtype=torch.float64)
    adv, _ = group_advantages(rewards, scale_by_group_std=True, batch_zscore=True)
    assert adv.abs().max() < 1e-3


def test_std_floor_bounds_the_scaling_of_tiny_spreads():
    rewards = torch.tensor([[0.0, 1e-3, 0.0, 1e-3]], dtype=torch.float64)  # std ~5.8e-4 < floor 1e-2
    adv, _ = group_advantages(rewards, scale_by_group_std=True, std_floor=1e-2)
    assert adv.abs().max() <= 0.5e-3 / 1e-2 + 1e-9


def test_nan_reward_gets_zero_advantage_and_does_not_poison_its_group():
    rewards = torch.tensor([[1.0, float("nan"), 0.0, 0.5]])
    adv, stats = group_advantages(rewards)
    assert torch.isfinite(adv).all()
    assert adv[0, 1] == 0.0
    torch.testing.assert_close(adv[0, [0, 2, 3]], torch.tensor([0.5, -0.5, 0.0]))
    assert stats.n_invalid_rewards == 1


def test_group_with_a_single_valid_reward_is_degenerate():
    adv, stats = group_advantages(torch.tensor([[float("nan"), 0.3, float("inf")]]))
    assert torch.equal(adv, torch.zeros(1, 3)) and stats.n_degenerate_groups == 1 and stats.n_invalid_rewards == 2


def test_batch_zscore_scales_all_advantages_by_the_batch_std():
    rewards = torch.tensor([[0.0, 2.0], [1.0, 1.0]], dtype=torch.float64)
    plain, _ = group_advantages(rewards)
    z, stats = group_advantages(rewards, batch_zscore=True)
    torch.testing.assert_close(z, plain / stats.reward_std)
