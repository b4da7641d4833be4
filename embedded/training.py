"""What the three builds share: the learning-rate schedule, the prompt + answer batch and its loss step, and a
build's isolation from the caller's torch threads and random state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


def warmup_cosine_schedule(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10 % of the peak (a `LambdaLR` factor per step)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def answer_batch(
    prompt_ids: list[list[int]], answer_ids: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask and labels [B, L] of prompt + answer rows, right-padded with `pad_id`; labels
    are -100 outside the answer, so the loss covers the answer (and its end token) only."""
    length = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids, strict=True))
    input_ids = torch.full((len(prompt_ids), length), pad_id)  # [B, L]
    labels = torch.full((len(prompt_ids), length), -100)  # [B, L]
    mask = torch.zeros((len(prompt_ids), length), dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompt_ids, answer_ids, strict=True)):
        input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask[i, : len(p) + len(a)] = 1
    return input_ids, mask, labels


def answer_loss_step(model: Any, opt: torch.optim.Optimizer, sched: Any, batch: tuple[torch.Tensor, ...]) -> None:
    """One optimiser step of next-token cross-entropy on the labelled positions of `answer_batch`'s rows."""
    input_ids, mask, labels = batch
    hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [B, L, H]
    targets = labels[:, 1:]  # [B, L-1]: position t predicts token t+1
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V], the answer positions only
    loss = F.cross_entropy(logits, targets[keep])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


@contextmanager
def isolated_build() -> Iterator[None]:
    """One torch thread and no progress bars while building; the caller's threads and global RNG are restored."""
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    # One thread: the weights are bitwise the same with 1 or 2 (measured), one thread is only ~1.3x slower on
    # an idle 2-core machine, and it stays fast while another process competes for the cores (2 threads were
    # 5x slower then). The caller's thread count and global RNG state are restored afterwards.
    torch.set_num_threads(1)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bars
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()
