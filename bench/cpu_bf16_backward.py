"""The backward of a frozen linear layer in bfloat16 on this CPU, side by side: PyTorch's ordinary op (grad @ W, both
row-major) and `core/models/cpu_matmul.py` (the gradient laid out transposed), for each of Qwen3-4B's projection
shapes and its LM head, with float32 for reference. On a CPU without AVX-512 the ordinary op takes PyTorch's slow
fallback kernel (pytorch/pytorch#146508); with AVX-512 both take oneDNN and the ratio is ~1.

    python bench/cpu_bf16_backward.py [--tokens 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from redteam_grpo.core.models.cpu_matmul import _FrozenLinear

H, Q, KV, FFN, V = 2560, 32 * 128, 8 * 128, 9728, 151_936
# (name, out_features, in_features) of Qwen3-4B's frozen linear layers, and how many a 36-layer model has
SHAPES = [("q_proj", Q, H, 36), ("k_proj", KV, H, 36), ("v_proj", KV, H, 36), ("o_proj", H, Q, 36)]
SHAPES += [("gate_proj", FFN, H, 36), ("up_proj", FFN, H, 36), ("down_proj", H, FFN, 36), ("lm_head", V, H, 1)]


def backward_seconds(weight: torch.Tensor, tokens: int, routed: bool) -> float:
    x = torch.randn(tokens, weight.shape[1], dtype=weight.dtype, requires_grad=True)
    y = _FrozenLinear.apply(x, weight, None) if routed else torch.nn.functional.linear(x, weight)
    grad = torch.randn_like(y)
    started = time.perf_counter()
    y.backward(grad)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, threads: {torch.get_num_threads()}")
    table = Table(title=f"backward to the input of one frozen layer, {args.tokens} tokens, seconds")
    for column in ("layer", "float32", "bf16 ordinary", "bf16 routed", "ordinary / routed"):
        table.add_column(column, justify="right")
    totals = {"float32": 0.0, "ordinary": 0.0, "routed": 0.0}
    for dtype in (torch.float32, torch.bfloat16):  # warm-up: the first backward of a process pays its setup
        for routed in (False, True):
            backward_seconds(torch.randn(256, 256, dtype=dtype), args.tokens, routed)
    for name, out_features, in_features, count in SHAPES:
        weight = torch.randn(out_features, in_features) * 0.02
        fp32 = backward_seconds(weight, args.tokens, routed=False)
        weight = weight.bfloat16()
        ordinary = backward_seconds(weight, args.tokens, routed=False)
        routed = backward_seconds(weight, args.tokens, routed=True)
        for key, value in (("float32", fp32), ("ordinary", ordinary), ("routed", routed)):
            totals[key] += count * value
        table.add_row(name, f"{fp32:.4f}", f"{ordinary:.4f}", f"{routed:.4f}", f"{ordinary / routed:.1f}x")
    table.add_row(
        "36 layers + head",
        f"{totals['float32']:.2f}",
        f"{totals['ordinary']:.2f}",
        f"{totals['routed']:.2f}",
        f"{totals['ordinary'] / totals['routed']:.1f}x",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
