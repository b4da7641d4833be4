"""Frozen linear layers' backward in a layout PyTorch multiplies fast in bfloat16 on CPUs without AVX-512.

On such a CPU (AVX2 only) PyTorch has no oneDNN path for bfloat16 matmuls and falls back to its own kernels,
whose speed depends on the operands' memory layout (pytorch/pytorch#146508). Measured here, torch 2.13 on an
AVX2 EPYC, [64, 4096] @ [4096, 2560] in bfloat16: both operands row-major 0.3 GFLOP/s, the first transposed
14 GFLOP/s, the second transposed 20 GFLOP/s. A linear layer's forward, x @ W^T, is the fast case; its backward
to the input, grad @ W, is the slow one: with the LoRA base frozen, that product is nearly all of a training
step's time (a 2-layer model of Qwen3-4B's width spent 99.7 % of a step in it, 60x slower than float32).

`fast_frozen_linear_backward` replaces the backward of every frozen `nn.Linear` (LoRA's base layers, the LM head)
by the same product with the gradient laid out transposed (a copy of the gradient, never of the weight): the same
products with the same float32 accumulation, in another order, no memory held beyond what the forward saves. The
forward is untouched, so sampling, scoring and the trainer's logprobs are what they were. `load_policy` applies
it where it helps: the CPU, a 16-bit dtype, and no AVX-512 (`needs_fast_backward`).

`contiguous_head_input`: `generate`'s first step feeds the LM head the last position sliced out of the prompt's
hidden states, [B, 1, H] with the prompt's strides. PyTorch's CPU `linear` cannot fold such an input into one
matrix product and multiplies it batch-wise with the weight expanded and copied per row: measured on a Xeon with
AVX-512 (torch 2.13), 8 rows through Qwen3-4B's head (151,936 x 2,560, bfloat16) copied 6.2 GB, most of a sample
stage's peak memory (an AVX2 EPYC's sample stage showed no such copy). A contiguous
input (a copy of B x H values) gives the same logits, bit for bit, with no copy of the weight.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b with W and b frozen; dL/dx = g W computed as (g^T)^T W (the fast layout)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_N_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_N_out.t().contiguous().t() @ weight  # column-major gradient: PyTorch's fast bfloat16 path
        return grad_x.view(*grad_out.shape[:-1], weight.shape[1]), None, None


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad):
        return F.linear(x, self.weight, self.bias)  # trained after all (e.g. unfrozen later): the ordinary op
    if not torch.is_grad_enabled() or not x.requires_grad:
        return F.linear(x, self.weight, self.bias)
    return _FrozenLinear.apply(x, self.weight, self.bias)


def fast_frozen_linear_backward(model: torch.nn.Module) -> int:
    """Route the frozen `nn.Linear` layers of `model` through `_FrozenLinear`; the number of layers routed."""
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not module.weight.requires_grad:
            module.forward = types.MethodType(_forward, module)
            routed += 1
    return routed


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


def contiguous_head_input(model: torch.nn.Module) -> bool:
    """Make the LM head of a causal LM see a contiguous input (see the module docstring); False when it has none."""
    head = model.get_output_embeddings()
    if head is None:
        return False
    head.register_forward_pre_hook(_contiguous_input)
    return True


def needs_fast_backward(device: torch.device, dtype: torch.dtype) -> bool:
    """A CPU without AVX-512 computing in a 16-bit float: where PyTorch's fallback kernels are the slow ones."""
    reduced = dtype in (torch.bfloat16, torch.float16)
    return device.type == "cpu" and reduced and not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
