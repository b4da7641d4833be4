"""Frozen linear layers routed through the fast-layout backward give the gradients of the ordinary op, and leave the
forward bit-identical (bench/README.md has the speed)."""

import pytest
import torch

from redteam_grpo.core.config import ModelConfig
from redteam_grpo.core.models.cpu_matmul import fast_frozen_linear_backward, needs_fast_backward
from redteam_grpo.core.models.policy import load_policy


def _lora_gradients(policy, ids):
    policy.model.zero_grad(set_to_none=True)
    logits = policy.model(input_ids=ids).logits
    logits.float().log_softmax(-1)[..., 7].sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _unroute(model):
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" in vars(module):
            del module.forward  # back to nn.Linear.forward


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_routed_frozen_layers_give_the_ordinary_gradients_and_the_same_forward(embedded_assets, dtype):
    policy = load_policy(ModelConfig(dtype=dtype), 1.0, torch.device("cpu"), 0)
    _unroute(policy.model)
    for name, parameter in policy.model.named_parameters():
        if "lora_B" in name:  # B = 0 would leave A without gradient
            torch.nn.init.normal_(parameter, 0, 0.05)
    ids = torch.randint(0, len(policy.tokenizer), (3, 21), generator=torch.Generator().manual_seed(0))
    logits, grads = _lora_gradients(policy, ids)
    routed = fast_frozen_linear_backward(policy.model)
    assert routed == sum(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in policy.model.modules())
    assert routed > 0
    routed_logits, routed_grads = _lora_gradients(policy, ids)
    assert torch.equal(routed_logits, logits)
    assert grads.keys() == routed_grads.keys() and any("lora_A" in n for n in grads)
    tolerance = {"bfloat16": 2e-2, "float32": 1e-5}[dtype]
    for name, grad in grads.items():
        torch.testing.assert_close(routed_grads[name], grad, rtol=tolerance, atol=tolerance * grad.abs().max().item())


def test_the_routing_is_applied_where_bfloat16_is_slow_only():
    cpu = torch.device("cpu")
    assert not needs_fast_backward(cpu, torch.float32)
    assert not needs_fast_backward(torch.device("cuda"), torch.bfloat16)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert needs_fast_backward(cpu, torch.bfloat16) is not avx512


def test_the_lm_head_sees_a_contiguous_input_when_sampling_so_its_weight_is_not_copied_per_row(embedded_assets):
    """generate's first step slices the last position out of the prompt's hidden states; a sliced input makes
    PyTorch's CPU linear copy the head's weight once per row (6.2 GB for 8 rows of Qwen3-4B's head)."""
    from redteam_grpo.core.rollouts.sampling import sample_completions

    policy = load_policy(ModelConfig(dtype="bfloat16"), 1.0, torch.device("cpu"), 0)
    seen: list[bool] = []
    policy.model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append(args[0].is_contiguous())
    )
    prompts = [[*range(5, 5 + n)] for n in (7, 12, 9)]
    sample_completions(policy, prompts, 2, 3, batch_size=6, seed=0)
    assert seen and all(seen), seen


def test_a_sliced_input_to_the_head_gives_the_same_logits_made_contiguous():
    head = torch.nn.Linear(64, 1000, bias=False, dtype=torch.bfloat16)
    hidden = torch.randn(4, 9, 64, dtype=torch.bfloat16)
    sliced = hidden[:, -1:, :]
    assert not sliced.is_contiguous()
    expected = head(sliced)
    from redteam_grpo.core.models.cpu_matmul import contiguous_head_input

    model = torch.nn.Module()
    model.get_output_embeddings = lambda: head
    assert contiguous_head_input(model)
    assert torch.equal(head(sliced), expected)
