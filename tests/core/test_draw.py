"""The sampler's draw (core/rollouts/sampling.py: draw_tokens): tokens come from the recorded distribution, and an id
of probability 0 is never drawn, whatever the uniform draw."""

import math

import torch

from redteam_grpo.core.rollouts.sampling import draw_tokens


def test_draws_follow_the_distribution_and_never_an_id_of_probability_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    draws = 200_000
    logprobs = probs.log().expand(draws, -1)
    tokens = draw_tokens(logprobs, torch.Generator().manual_seed(0))[:, 0]
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    expected = draws * probs.double()
    positive = probs > 0
    chi2 = float(((counts[positive] - expected[positive]) ** 2 / expected[positive]).sum())
    # 2 degrees of freedom: P(chi2 > 20) = e^-10 = 4.5e-5, and the seed is fixed; a draw from another distribution
    # (one id's share off by 1 %) gives chi2 > 80 at this many draws
    assert chi2 < 20.0, (counts / draws).tolist()


def test_a_uniform_draw_at_either_end_lands_on_an_id_of_positive_probability(monkeypatch):
    largest_below_one = 1.0 - 2.0**-53
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, largest_below_one, dtype=kw["dtype"]))
    logprobs = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf, -math.inf]])
    assert draw_tokens(logprobs, torch.Generator()).tolist() == [[1]]
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape, dtype=kw["dtype"]))
    first_zero = torch.tensor([[-math.inf, math.log(0.25), math.log(0.75)]])
    assert draw_tokens(first_zero, torch.Generator()).tolist() == [[1]]  # a uniform 0 skips the leading zero
