"""Supervised fine-tuning of a LoRA adapter on (input → target) pairs: the attacker of defense mode.

Each pair is formatted by `core/models/chat.py: format_sft_ids`, whose prompt part is exactly `format_prompt_ids` (the
ids RL samples from), so the adapter learns to answer the prompts it will see in the attack stage (bug class
`sft-prompt-format-drift`). The target is tokenized on its own and closed with the end-of-turn token. The loss
is the mean cross-entropy over target tokens only (the prompt is context, never a label), computed on the same
packed layout and logits offset as the RL loss (`core/tokens/masks.py` through `core/models/policy.py:
completion_logits`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from redteam_grpo.core.models.chat import format_sft_ids, turn_closing_id
from redteam_grpo.core.models.policy import Policy, completion_logits


@dataclass(frozen=True)
class SftExample:
    example_id: str
    prompt_ids: list[int]  # exactly format_prompt_ids(input)
    target_ids: list[int]  # the target's tokens and the end-of-turn token: the only labelled positions


@dataclass(frozen=True)
class SftStats:
    """One epoch of SFT: the train loss (mean over the epoch's target tokens) and the held-out loss after it."""

    train_loss: float
    eval_loss: float
    train_tokens: int
    eval_tokens: int
    steps: int
    grad_norm_mean: float


def sft_examples(policy: Policy, pairs: Sequence[tuple[str, str, str]], system_prompt: str | None) -> list[SftExample]:
    """(id, input, target) pairs as token ids; the turn is closed the way the chat template closes one."""
    end_of_turn = turn_closing_id(policy.tokenizer, policy.end_of_turn_ids)
    out = []
    for example_id, text, target in pairs:
        ids, prompt_length = format_sft_ids(policy.tokenizer, text, target, system_prompt, end_of_turn)
        out.append(SftExample(example_id, ids[:prompt_length], ids[prompt_length:]))
    return out


def _summed_nll(policy: Policy, batch: Sequence[SftExample]) -> tuple[torch.Tensor, int]:
    """Summed −log p(target tokens | prompt) over the batch, and how many target tokens it covers."""
    logits_B_C_V, targets_B_C, mask_B_C = completion_logits(
        policy, [e.prompt_ids for e in batch], [e.target_ids for e in batch]
    )
    logprobs_B_C = torch.log_softmax(logits_B_C_V, dim=-1).gather(-1, targets_B_C.unsqueeze(-1)).squeeze(-1)
    return -(logprobs_B_C * mask_B_C).sum(), int(mask_B_C.sum().item())


@torch.no_grad()
def sft_loss(policy: Policy, examples: Sequence[SftExample], micro_batch_size: int) -> tuple[float, int]:
    """Mean per-token loss of `examples` (the held-out loss) and their token count; NaN for none."""
    total, tokens = 0.0, 0
    for start in range(0, len(examples), micro_batch_size):
        nll, n = _summed_nll(policy, examples[start : start + micro_batch_size])
        total, tokens = total + float(nll), tokens + n
    return (total / tokens if tokens else math.nan), tokens


def sft_epoch(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    train: Sequence[SftExample],
    held_out: Sequence[SftExample],
    batch_size: int,
    micro_batch_size: int,
    grad_clip: float | None,
    seed: int,
) -> SftStats:
    """One pass over `train` in a seeded order, one optimizer step per `batch_size` examples, each step's loss the
    mean over its target tokens (exact under micro-batching); then the held-out loss."""
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    params = policy.trainable_parameters()
    total, tokens, steps, norms = 0.0, 0, 0, []
    for start in range(0, len(order), batch_size):
        batch = [train[i] for i in order[start : start + batch_size]]
        batch_tokens = sum(len(e.target_ids) for e in batch)
        optimizer.zero_grad(set_to_none=True)
        for m in range(0, len(batch), micro_batch_size):
            nll, _ = _summed_nll(policy, batch[m : m + micro_batch_size])
            (nll / batch_tokens).backward()
            total += float(nll.detach())
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
        optimizer.step()
        tokens += batch_tokens
        steps += 1
        norms.append(float(norm))
    eval_loss, eval_tokens = sft_loss(policy, held_out, micro_batch_size)
    return SftStats(
        train_loss=total / tokens if tokens else math.nan,
        eval_loss=eval_loss,
        train_tokens=tokens,
        eval_tokens=eval_tokens,
        steps=steps,
        grad_norm_mean=sum(norms) / len(norms) if norms else math.nan,
    )
