"""Data-parallel GRPO updates over a torch.distributed process group (training.launcher=torchrun).

Every process holds the same weights and the whole batch; each computes the loss of its share of the micro-batches
with the batch-wide normaliser (`core/training/loss.py: token_weights`), so its gradient is its share of the batch's
sum. The shares' gradients are summed across processes before clipping and the optimizer step, which every process then
takes identically: the update equals the single-process one up to the order of float additions. The statistics
(sums, counts, maxima) are reduced the same way, so the ratio check refuses or passes a step in every process at
once.

This is DistributedDataParallel's reduction, written out: DDP reduces after each backward (in buckets, overlapped
with it), which micro-batches accumulated before one step would have to switch off (`no_sync`) anyway; a LoRA
adapter's gradient is a few MB, reduced once per optimizer step as one flat tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class ReplicaDivergenceError(RuntimeError):
    """The processes' weights differ after an update: they did not take the same step."""


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the default process group."""

    rank: int
    world_size: int

    @classmethod
    def current(cls) -> DataParallel:
        return cls(dist.get_rank(), dist.get_world_size())

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's items: every world_size-th, from its rank (micro-batches are ordered by length, so the
        shares are close in size)."""
        return list(items[self.rank :: self.world_size])

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum the parameters' gradients over every process, in place (a process with no micro-batch adds 0)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def _reduce(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def check_same_weights(self, params: Sequence[torch.Tensor]) -> None:
        """Refuse weights that differ between processes (a step that was not the same everywhere)."""
        flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params]).to(self._device())
        low, high = flat.clone(), flat.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        spread = float((high - low).abs().max()) if flat.numel() else 0.0
        if spread > 0.0:
            raise ReplicaDivergenceError(
                f"the {self.world_size} processes' adapters differ by up to {spread:.3e} after the update: their "
                "gradients were not summed into one step. The update was not saved"
            )

    @staticmethod
    def _device() -> torch.device:
        # NCCL reduces CUDA tensors only; gloo CPU ones
        return (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
