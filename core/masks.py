"""Packing (prompt, completion) token ids into model inputs, and the completion positions in them.

Every mask here comes from lengths, never from token values: a mask built as `ids != pad` hides the EOS when pad == eos
(the bug TRL reverted) and counts prompt padding as response under left padding (bug classes `mask-from-token-values`,
`response-cut-by-non-pad-count`, `mask-off-by-one` in docs/bug-classes.md). Shape suffixes: B = sequences, T = packed
length, C = longest completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch

Padding = Literal["left", "right"]


@dataclass(frozen=True)
class PackedBatch:
    input_ids_B_T: torch.Tensor  # long
    attention_mask_B_T: torch.Tensor  # long, 1 = real token
    position_ids_B_T: torch.Tensor  # long, cumsum(mask) - 1: what `generate` uses under left padding
    logit_positions_B_C: torch.Tensor  # long, index t whose logits predict completion token c
    completion_ids_B_C: torch.Tensor  # long, 0 past each completion's end
    completion_mask_B_C: torch.Tensor  # bool, c < completion length

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def position_ids_from_mask(attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token, whatever the padding side."""
    return (attention_mask_B_T.long().cumsum(-1) - 1).clamp(min=0)


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    padding: Padding = "right",
) -> PackedBatch:
    """Concatenate each prompt with its completion and pad the rows to one length.

    Completion token c of row b sits at packed index `offset_b + P_b + c` and is predicted by the logits at
    one index earlier; `logit_positions_B_C` holds exactly those indices (the off-by-one lives here only).
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("an empty prompt cannot be packed: its first completion token has no predicting position")
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width, longest_completion = max(lengths), max((len(c) for c in completion_ids), default=0)
    n = len(lengths)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    positions = torch.zeros((n, max(longest_completion, 1)), dtype=torch.long)
    targets = torch.zeros((n, max(longest_completion, 1)), dtype=torch.long)
    mask = torch.zeros((n, max(longest_completion, 1)), dtype=torch.bool)
    for b, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        offset = width - lengths[b] if padding == "left" else 0
        row = torch.tensor([*prompt, *completion], dtype=torch.long)
        input_ids[b, offset : offset + lengths[b]] = row
        attention[b, offset : offset + lengths[b]] = 1
        first_logit = offset + len(prompt) - 1
        n_completion = len(completion)
        positions[b, :n_completion] = torch.arange(first_logit, first_logit + n_completion)
        positions[b, n_completion:] = first_logit  # any valid index; masked out
        targets[b, :n_completion] = torch.tensor(completion, dtype=torch.long)
        mask[b, :n_completion] = True
    return PackedBatch(
        input_ids_B_T=input_ids,
        attention_mask_B_T=attention,
        position_ids_B_T=position_ids_from_mask(attention),
        logit_positions_B_C=positions[:, :longest_completion] if longest_completion else positions[:, :0],
        completion_ids_B_C=targets[:, :longest_completion] if longest_completion else targets[:, :0],
        completion_mask_B_C=mask[:, :longest_completion] if longest_completion else mask[:, :0],
    )


def gather_completion_logits(logits_B_T_V: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Logits that predict each completion token: [B, C, V]."""
    index = packed.logit_positions_B_C.unsqueeze(-1).expand(-1, -1, logits_B_T_V.shape[-1])
    return torch.gather(logits_B_T_V, 1, index)


def split_generated(
    sequences_B_S: torch.Tensor, input_width: int, end_of_turn_ids: Sequence[int]
) -> tuple[list[list[int]], list[str]]:
    """Cut `generate` output into completions at the absolute input width (never by counting non-pad tokens).

    A completion ends after its first end-of-turn token (kept: the policy chose it and it enters the loss);
    everything after it is padding that `generate` appended. A completion without one ran to the end and has
    finish reason `length`. Pad ids inside a completion are kept: they were sampled.
    """
    generated = sequences_B_S[:, input_width:]
    is_end = torch.zeros_like(generated, dtype=torch.bool)
    for token in end_of_turn_ids:
        is_end |= generated == token
    completions, reasons = [], []
    for b in range(generated.shape[0]):
        ends = torch.nonzero(is_end[b]).flatten()
        if len(ends):
            completions.append(generated[b, : int(ends[0]) + 1].tolist())
            reasons.append("stop")
        else:
            completions.append(generated[b].tolist())
            reasons.append("length")
    return completions, reasons
