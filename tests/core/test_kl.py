import torch

from redteam_grpo.core.kl import k3_kl, sequence_kl


def test_k3_is_zero_when_policy_equals_reference_and_positive_otherwise():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    assert torch.equal(k3_kl(lp, lp, mask), torch.zeros(1, 3))
    ref = torch.tensor([[-1.5, -1.0, float("-inf")]])  # -inf at a masked position must not leak
    kl = k3_kl(lp, ref, mask)
    # r = ref - pol: -0.5 -> e^-0.5 + 0.5 - 1 = 0.10653; 1.0 -> e - 2 = 0.71828
    torch.testing.assert_close(kl, torch.tensor([[0.106531, 0.718282, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(sequence_kl(lp, ref, mask), torch.tensor([(0.106531 + 0.718282) / 2]), atol=1e-5, rtol=0)


def test_k3_estimates_the_true_kl_from_policy_samples():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    true_kl = (p * (p / q).log()).sum()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = k3_kl(p.log()[samples][None], q.log()[samples][None], torch.ones(1, 200_000, dtype=torch.bool)).mean()
    assert abs(estimate - true_kl) < 0.01
