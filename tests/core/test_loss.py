import pytest
import torch

from redteam_grpo.core.loss import clipped_importance_sampling_loss, importance_sampling_loss, token_weights


def test_token_weights_sum_to_one_over_the_batch_even_when_split_into_micro_batches():
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    whole = token_weights(mask, "token", n_tokens=6, n_sequences=3).sum()
    parts = token_weights(mask[:2], "token", 6, 3).sum() + token_weights(mask[2:], "token", 6, 3).sum()
    assert whole == pytest.approx(1.0) and parts == pytest.approx(1.0)
    seq = token_weights(mask, "sequence", n_tokens=6, n_sequences=3)
    # each sequence weighs 1/3 whatever its length
    torch.testing.assert_close(seq.sum(-1), torch.full((3,), 1 / 3))


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
    assert stats.ratio_mean.item() == pytest.approx(1.0) and stats.ratio_std.item() == pytest.approx(0.0)


def test_masked_positions_holding_minus_inf_do_not_produce_nan():
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    sample = torch.tensor([[-1.0, 0.0]])
    mask = torch.tensor([[True, False]])
    loss, _ = importance_sampling_loss(logprobs, sample, torch.tensor([1.0]), token_weights(mask, "token", 1, 1), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_clipped_loss_stops_the_gradient_past_the_clip_range():
    sample = torch.tensor([[0.0, 0.0]])
    logprobs = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()  # ratios 1.5 (clipped) and 1.1
    mask = torch.tensor([[True, True]])
    loss, stats = clipped_importance_sampling_loss(
        logprobs, sample, torch.tensor([1.0]), token_weights(mask, "token", 2, 1), mask, clip_epsilon=0.2
    )
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 1] != 0.0
    assert stats.clip_fraction.item() == pytest.approx(0.5)
    # objective = (1.2 + 1.1) / 2
    assert loss.item() == pytest.approx(-(1.2 + 1.1) / 2)
