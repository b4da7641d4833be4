"""The loss family on hand-worked numbers: each value in a comment is computed by hand from the inputs above it."""

import math

import pytest
import torch

from redteam_grpo.core.training.loss import (
    LossStats,
    gspo_loss,
    importance_sampling_loss,
    mismatch_weights,
    ppo_clip_loss,
    ratio_stats,
    token_weights,
)

MASK = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])  # lengths 2, 3, 1


def test_token_weights_sum_to_one_over_the_batch_even_when_split_into_micro_batches():
    whole = token_weights(MASK, "token", n_tokens=6, n_sequences=3).sum()
    parts = token_weights(MASK[:2], "token", 6, 3).sum() + token_weights(MASK[2:], "token", 6, 3).sum()
    assert whole == pytest.approx(1.0) and parts == pytest.approx(1.0)
    seq = token_weights(MASK, "sequence", n_tokens=6, n_sequences=3)
    # each sequence weighs 1/3 whatever its length: 1/6 per token of the first, 1/9 of the second, 1/3 of the third
    torch.testing.assert_close(seq.sum(-1), torch.full((3,), 1 / 3))
    torch.testing.assert_close(seq[:, 0], torch.tensor([1 / 6, 1 / 9, 1 / 3]))


def test_constant_weights_divide_by_sequences_times_max_new_tokens():
    # Dr. GRPO: 3 sequences x max_new_tokens 4 = 12, so every token weighs 1/12 whatever the lengths;
    # the 6 tokens sum to 6/12 = 0.5 (not 1: the batch is shorter than its budget).
    weights = token_weights(MASK, "constant", n_tokens=6, n_sequences=3, max_new_tokens=4)
    torch.testing.assert_close(weights, MASK.float() / 12)
    # micro-batches [0:2] and [2:3] use the batch's 3 sequences, not their own 2 and 1
    parts = token_weights(MASK[:2], "constant", 6, 3, 4).sum() + token_weights(MASK[2:], "constant", 6, 3, 4).sum()
    assert parts.item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        token_weights(MASK, "constant", 6, 3)


def test_on_policy_loss_value_and_gradient_are_the_plain_policy_gradient():
    # Hand-worked: 2 sequences, advantages [1, -2]; first has 2 tokens, second 1 token; token weights 1/3.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    sample = logprobs.detach().clone()  # on-policy: ratio = 1
    mask = torch.tensor([[True, True], [True, False]])
    weights = token_weights(mask, "token", 3, 2)
    loss, stats = importance_sampling_loss(logprobs, sample, torch.tensor([1.0, -2.0]), weights, mask)
    # loss = -(1 + 1 - 2) / 3 = 0
    assert loss.item() == pytest.approx(0.0)
    loss.backward()
    # d loss / d logprob = -A * ratio * w  -> [-1/3, -1/3], [2/3, 0]
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))
    assert stats.ratio_mean == pytest.approx(1.0) and stats.ratio_std == pytest.approx(0.0)
    assert stats.n_tokens == 3 and stats.kl == pytest.approx(0.0) and stats.clip_fraction == 0.0


def test_masked_positions_holding_minus_inf_do_not_produce_nan():
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    sample = torch.tensor([[-1.0, 0.0]])
    mask = torch.tensor([[True, False]])
    for loss_fn in (
        importance_sampling_loss,
        lambda *a: ppo_clip_loss(*a, epsilon_low=0.2, epsilon_high=0.28),
        lambda *a: gspo_loss(*a, epsilon_low=3e-4, epsilon_high=4e-4),
    ):
        logprobs.grad = None
        loss, _ = loss_fn(logprobs, sample, torch.tensor([1.0]), token_weights(mask, "token", 1, 1), mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


# Two sequences of 3 tokens: the first with advantage +1, the second -1. Token weights 1/6.
PPO_RATIOS = torch.tensor([[1.5, 1.25, 0.7], [0.7, 0.9, 1.5]])
PPO_ADVANTAGES = torch.tensor([1.0, -1.0])


def test_ppo_clip_with_clip_higher_uses_separate_low_and_high_ranges():
    logprobs = PPO_RATIOS.log().requires_grad_()
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, stats = ppo_clip_loss(
        logprobs, torch.zeros(2, 3), PPO_ADVANTAGES, token_weights(mask, "token", 6, 2), mask, 0.2, 0.28
    )
    # clip range [0.8, 1.28]; the objective per token is min(r A, clip(r) A):
    #   A = +1: 1.5 -> min(1.5, 1.28) = 1.28 (clipped); 1.25 -> 1.25 (inside 1.28: DAPO's clip-higher keeps it,
    #           symmetric 0.2 would clip it at 1.2); 0.7 -> min(0.7, 0.8) = 0.7 (unclipped: the min keeps r)
    #   A = -1: 0.7 -> min(-0.7, -0.8) = -0.8 (clipped); 0.9 -> -0.9; 1.5 -> min(-1.5, -1.28) = -1.5 (unclipped)
    # sum = 1.28 + 1.25 + 0.7 - 0.8 - 0.9 - 1.5 = 0.03; loss = -0.03 / 6 = -0.005
    assert loss.item() == pytest.approx(-0.005, abs=1e-6)
    loss.backward()
    # d loss / d logprob = -w A r where unclipped, 0 where clipped
    expected = torch.tensor([[0.0, -1.25, -0.7], [0.0, 0.9, 1.5]]) / 6
    torch.testing.assert_close(logprobs.grad, expected)
    assert stats.clip_fraction == pytest.approx(2 / 6) and stats.n_clipped == 2


def test_symmetric_ppo_clip_stops_the_gradient_past_the_clip_range():
    sample = torch.tensor([[0.0, 0.0]])
    logprobs = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()  # ratios 1.5 (clipped) and 1.1
    mask = torch.tensor([[True, True]])
    loss, stats = ppo_clip_loss(
        logprobs,
        sample,
        torch.tensor([1.0]),
        token_weights(mask, "token", 2, 1),
        mask,
        epsilon_low=0.2,
        epsilon_high=0.2,
    )
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 1] != 0.0
    assert stats.clip_fraction == pytest.approx(0.5)
    # objective = (1.2 + 1.1) / 2
    assert loss.item() == pytest.approx(-(1.2 + 1.1) / 2)


def test_gspo_clips_one_ratio_per_sequence_the_geometric_mean_of_its_token_ratios():
    # sequence 0: token ratios 2 and 1/2 -> s = exp((log 2 - log 2) / 2) = 1, inside [1 - 3e-4, 1 + 4e-4]
    # sequence 1: token log-ratios 0.0015, 0, 0 -> s = exp(0.0005) = 1.0005 > 1.0004: clipped (A = +1)
    log_ratios = torch.tensor([[math.log(2.0), math.log(0.5), 0.0], [0.0015, 0.0, 0.0]])
    logprobs = log_ratios.clone().requires_grad_()
    mask = torch.tensor([[True, True, False], [True, True, True]])
    weights = token_weights(mask, "sequence", n_tokens=5, n_sequences=2)  # the paper's 1/G per sequence
    loss, stats = gspo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), weights, mask, 3e-4, 4e-4)
    # objective = 1/2 * min(1, 1) + 1/2 * min(1.0005, 1.0004) = 1/2 + 1.0004/2 = 1.0002
    assert loss.item() == pytest.approx(-1.0002, abs=1e-6)
    loss.backward()
    # sequence 0: d/d lp_t of -(1/2) s A, s = exp(mean lp) -> -(1/2) * s * A / |y| = -(1/2)(1)(1)/2 = -1/4 per token
    #   (a per-token ratio would clip the ratio-2 token and give [0, -1/4 * 1/2]: different)
    # sequence 1: clipped, no gradient
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]]))
    # clip counted per token of clipped sequences: 3 of 5; ratio stats are of the token ratios
    assert stats.n_clipped == 3 and stats.clip_fraction == pytest.approx(3 / 5)
    token_ratios = torch.tensor([2.0, 0.5, math.exp(0.0015), 1.0, 1.0], dtype=torch.float64)
    assert stats.ratio_mean == pytest.approx(float(token_ratios.mean()), rel=1e-6)
    assert stats.ratio_max == pytest.approx(2.0)


def test_gspo_with_a_negative_advantage_clips_below():
    # one sequence, token log-ratios -0.001, -0.001 -> s = exp(-0.001) = 0.9990005 < 1 - 3e-4 = 0.9997, A = -1:
    # min(-0.9990005, -0.9997) = -0.9997 (clipped, no gradient); loss = +0.9997
    logprobs = torch.tensor([[-0.001, -0.001]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = gspo_loss(
        logprobs, torch.zeros(1, 2), torch.tensor([-1.0]), token_weights(mask, "sequence", 2, 1), mask, 3e-4, 4e-4
    )
    assert loss.item() == pytest.approx(0.9997, abs=1e-7)
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(1, 2)) and stats.clip_fraction == 1.0


# Two sequences of 3 tokens, the second with its last token padding. rho = p_trainer / p_sampler per token:
#   sequence 0: 0.6/0.2 = 3, 0.3/0.6 = 0.5, 0.5/0.5 = 1      (product 1.5)
#   sequence 1: 0.4/0.1 = 4, 0.9/0.3 = 3,   padding          (product 12)
TRAINER = torch.tensor([[0.6, 0.3, 0.5], [0.4, 0.9, 0.2]]).log()
SAMPLER = torch.tensor([[0.2, 0.6, 0.5], [0.1, 0.3, 0.7]]).log()
TWO_SEQUENCES = torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize(
    ("method", "low", "high", "weights", "acted"),
    [
        # Yao et al. 2025: min(rho, 2) per token
        ("token_truncate", None, 2.0, [[2.0, 0.5, 1.0], [2.0, 2.0, 1.0]], [[1, 0, 0], [1, 1, 0]]),
        # a lower bound truncates from below too
        ("token_truncate", 0.8, 2.0, [[2.0, 0.8, 1.0], [2.0, 2.0, 1.0]], [[1, 1, 0], [1, 1, 0]]),
        # TRL's sequence_truncate, high 3: sequence 0 keeps its product 1.5 (log 0.41 < log 3) on every token,
        # sequence 1's product 12 (log 2.48 > log 3) is truncated to 3 on its two tokens; its padding stays 1, unmarked
        ("sequence_truncate", None, 3.0, [[1.5, 1.5, 1.5], [3.0, 3.0, 1.0]], [[0, 0, 0], [1, 1, 0]]),
        # TRL's sequence_mask, high 3: sequence 0 keeps its product 1.5 on every token, sequence 1 (12) is dropped
        ("sequence_mask", None, 3.0, [[1.5, 1.5, 1.5], [0.0, 0.0, 1.0]], [[0, 0, 0], [1, 1, 0]]),
        # IcePop [0.45, 5]: every rho is inside, each kept as is
        ("icepop", 0.45, 5.0, [[3.0, 0.5, 1.0], [4.0, 3.0, 1.0]], [[0, 0, 0], [0, 0, 0]]),
        # IcePop [0.6, 3.5]: 0.5 and 4 fall outside, 3 stays
        ("icepop", 0.6, 3.5, [[3.0, 0.0, 1.0], [0.0, 3.0, 1.0]], [[0, 1, 0], [1, 0, 0]]),
    ],
)
def test_mismatch_corrections_on_hand_worked_ratios(method, low, high, weights, acted):
    trainer = TRAINER.clone().requires_grad_()
    factors, corrected = mismatch_weights(trainer, SAMPLER, TWO_SEQUENCES, method, low, high)
    torch.testing.assert_close(factors, torch.tensor(weights))  # padding: 1 (its token weight is 0 anyway)
    assert torch.equal(corrected, torch.tensor(acted, dtype=torch.bool))
    assert not factors.requires_grad  # a constant factor: no gradient flows through it


def _trl_is_ratio(old_logps, sampling_logps, mask, mode, clip_min, clip_max):
    """TRL 1.16's engine correction, replayed line by line from `GRPOTrainer._generate_and_score_completions`
    (trl/trainer/grpo_trainer.py, "Compute the importance sampling ratio when using vLLM"), where it is inline."""
    per_token_logps_diff = (old_logps - sampling_logps) * mask
    if mode in ("sequence_mask", "sequence_truncate"):
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


@pytest.mark.parametrize(
    ("ours", "trl_mode", "low", "high"),
    [
        ("token_truncate", "token_truncate", None, 2.0),
        ("sequence_truncate", "sequence_truncate", None, 3.0),  # TRL's default cap
        ("sequence_truncate", "sequence_truncate", 0.5, 3.0),
        ("sequence_mask", "sequence_mask", None, 3.0),  # TRL's defaults
        ("icepop", "token_mask", 0.5, 5.0),
    ],
)
def test_mismatch_corrections_give_trls_factors_on_random_logprobs(ours, trl_mode, low, high):
    generator = torch.Generator().manual_seed(0)
    trainer = torch.randn(64, 12, generator=generator) * 2 - 3
    sampler = trainer + torch.randn(64, 12, generator=generator) * 0.5  # large mismatches: many bounds cross
    mask = torch.arange(12) < torch.randint(1, 13, (64, 1), generator=generator)
    factors, corrected = mismatch_weights(trainer, sampler, mask, ours, low, high)
    expected = _trl_is_ratio(trainer, sampler, mask.float(), trl_mode, low, high).expand_as(factors)
    torch.testing.assert_close(torch.where(mask, factors, 0.0), torch.where(mask, expected, 0.0))
    assert corrected.any() and not corrected.all()  # the bounds were crossed, so the comparison means something
    # where TRL's ratio before truncation or masking is outside [low, high] (its invalid_mis_mask), on trained tokens;
    # the mask mode of the same granularity without bounds is that ratio
    raw = _trl_is_ratio(trainer, sampler, mask.float(), trl_mode.replace("truncate", "mask"), None, None)
    raw = raw.expand_as(factors)
    outside = (raw < (low or 0.0)) | (raw > high)
    assert torch.equal(corrected, outside & mask)


def test_sequence_truncate_gives_every_token_the_one_truncated_sequence_ratio_from_below_too():
    # sampler and trainer of the hand-worked example swapped: rho per token 1/3, 2, 1 and 1/4, 1/3, padding;
    # products 2/3 and 1/12. [0.1, 3]: sequence 0 keeps 2/3 on every token, sequence 1 is raised to 0.1
    factors, corrected = mismatch_weights(SAMPLER, TRAINER, TWO_SEQUENCES, "sequence_truncate", 0.1, 3.0)
    torch.testing.assert_close(factors, torch.tensor([[2 / 3, 2 / 3, 2 / 3], [0.1, 0.1, 1.0]]))
    assert torch.equal(corrected, torch.tensor([[False, False, False], [True, True, False]]))


def test_sequence_truncate_of_a_ratio_that_overflows_exp_is_the_bound_exactly():
    # 1000 tokens of log-ratio +1 (rho e, inside [0.25, 3]) and 1000 of -1 (rho 1/e, inside too), then padding of
    # -2000 and +2000 (not summed; summed, it would flip both): summed log-ratios +1000 and -1000, whose exp is inf
    # and 0 in float32 (and float64)
    trainer = torch.tensor([[1.0] * 1000 + [-2000.0], [-1.0] * 1000 + [2000.0]])
    mask = (torch.arange(1001) < 1000).expand(2, -1)
    factors, corrected = mismatch_weights(trainer, torch.zeros(2, 1001), mask, "sequence_truncate", 0.25, 3.0)
    assert torch.isfinite(factors).all()
    # the bounds exactly: exp(log 3) and exp(log 0.25) round back to 3 and 0.25 in float32
    expected = torch.tensor([[3.0] * 1000 + [1.0], [0.25] * 1000 + [1.0]])
    torch.testing.assert_close(factors, expected, rtol=0, atol=0)
    assert torch.equal(corrected, mask)
    factors, _ = mismatch_weights(trainer, torch.zeros(2, 1001), mask, "sequence_truncate", None, 3.0)
    torch.testing.assert_close(factors, torch.tensor([[3.0] * 1000 + [1.0], [0.0] * 1000 + [1.0]]), rtol=0, atol=0)


def test_loss_stats_add_up_exactly_over_micro_batches():
    ratios = torch.tensor([[1.5, 1.25, 0.7], [0.7, 0.9, 1.5], [1.1, 2.0, 0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    values = ratios[mask].double()
    whole = ratio_stats(ratios.log(), torch.zeros(3, 3), mask)
    parts = ratio_stats(ratios[:1].log(), torch.zeros(1, 3), mask[:1]) + ratio_stats(
        ratios[1:].log(), torch.zeros(2, 3), mask[1:]
    )
    for stats in (whole, parts):
        assert stats.n_tokens == 6
        assert stats.ratio_mean == pytest.approx(float(values.mean()))
        assert stats.ratio_std == pytest.approx(float(values.std()))  # sample std, n - 1
        assert stats.ratio_max == pytest.approx(1.5)
        assert stats.ratio_abs_dev == pytest.approx(float((values - 1).abs().mean()))
        assert stats.kl == pytest.approx(float((values - 1 - values.log()).mean()))
    empty = LossStats()
    assert empty.n_tokens == 0 and math.isnan(empty.ratio_mean) and math.isnan(empty.ratio_std)
    assert (empty + whole) == whole
