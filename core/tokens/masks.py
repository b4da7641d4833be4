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
    """Concatenate each prompt with its completion and pad the rows to one length: `pack_spans` with one span per
    row, the completion."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("an empty prompt cannot be packed: its first completion token has no predicting position")
    sequences = [[*p, *c] for p, c in zip(prompt_ids, completion_ids, strict=True)]
    spans = [[(len(p), len(p) + len(c))] for p, c in zip(prompt_ids, completion_ids, strict=True)]
    return pack_spans(sequences, spans, pad_id, padding)


def pack_spans(
    sequences: Sequence[Sequence[int]],
    spans: Sequence[Sequence[tuple[int, int]]],
    pad_id: int,
    padding: Padding = "right",
) -> PackedBatch:
    """Pad whole token sequences to one length; row b's trained tokens are those of its spans `[start, end)`, in
    order: a single-turn completion is one span, a dialogue role's own turns are several (core/rollouts/dialogue.py),
    and the tokens between them (the other role's turns, the template's glue) are context only.

    Token c of a span starting at `start` sits at packed index `offset_b + start + c` and is predicted by the
    logits at one index earlier; `logit_positions_B_C` holds exactly those indices (the off-by-one lives here only).
    """
    if len(sequences) != len(spans):
        raise ValueError(f"{len(sequences)} sequences but {len(spans)} span lists")
    lengths = [len(s) for s in sequences]
    trained = [sum(end - start for start, end in row) for row in spans]
    for b, row in enumerate(spans):
        previous_end = 1  # a trained token needs a token before it to be predicted from
        for start, end in row:
            if not previous_end <= start <= end <= lengths[b]:
                raise ValueError(
                    f"row {b}: span [{start}, {end}) is out of order, overlaps, starts at 0 or runs past its "
                    f"{lengths[b]} tokens"
                )
            previous_end = end
    width, longest = max(lengths), max(trained, default=0)
    n = len(lengths)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    positions = torch.zeros((n, max(longest, 1)), dtype=torch.long)
    targets = torch.zeros((n, max(longest, 1)), dtype=torch.long)
    mask = torch.zeros((n, max(longest, 1)), dtype=torch.bool)
    for b, (sequence, row) in enumerate(zip(sequences, spans, strict=True)):
        offset = width - lengths[b] if padding == "left" else 0
        input_ids[b, offset : offset + lengths[b]] = torch.tensor(sequence, dtype=torch.long)
        attention[b, offset : offset + lengths[b]] = 1
        c = 0
        for start, end in row:
            first_logit = offset + start - 1
            positions[b, c : c + end - start] = torch.arange(first_logit, first_logit + end - start)
            targets[b, c : c + end - start] = torch.tensor(sequence[start:end], dtype=torch.long)
            mask[b, c : c + end - start] = True
            c += end - start
        positions[b, c:] = offset + (row[0][0] if row else 1) - 1  # any valid index; masked out
    return PackedBatch(
        input_ids_B_T=input_ids,
        attention_mask_B_T=attention,
        position_ids_B_T=position_ids_from_mask(attention),
        logit_positions_B_C=positions[:, :longest] if longest else positions[:, :0],
        completion_ids_B_C=targets[:, :longest] if longest else targets[:, :0],
        completion_mask_B_C=mask[:, :longest] if longest else mask[:, :0],
    )


def logits_window(packed: PackedBatch) -> int:
    """How many trailing positions of the packed rows hold logits that predict a trained token: the LM head need
    not run on the positions before the batch's earliest one (transformers' `logits_to_keep`). At a wide vocabulary
    the head costs as much as several decoder layers, and on prompts longer than their completions most of its work
    would be logits nobody reads (bench/head_positions.py). At least 1: `logits_to_keep=0` means every position."""
    width = packed.input_ids_B_T.shape[1]
    needed = packed.logit_positions_B_C[packed.completion_mask_B_C]
    return width - int(needed.min()) if needed.numel() else 1


def gather_completion_logits(logits_B_K_V: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Logits that predict each completion token: [B, C, V]. `logits_B_K_V` holds the logits of the packed rows'
    last K positions: all T of them, or the `logits_window` (whose positions start at T - K)."""
    first = packed.input_ids_B_T.shape[1] - logits_B_K_V.shape[1]
    if first < 0:
        raise ValueError(f"{logits_B_K_V.shape[1]} positions of logits for rows of {packed.input_ids_B_T.shape[1]}")
    positions_B_C = packed.logit_positions_B_C - first
    needed = positions_B_C[packed.completion_mask_B_C]
    if needed.numel() and int(needed.min()) < 0:
        raise ValueError(f"a trained token's logits lie before the last {logits_B_K_V.shape[1]} positions kept")
    # A padded entry may point before the window: it is masked, and any index in range will do.
    index = positions_B_C.clamp(min=0).unsqueeze(-1).expand(-1, -1, logits_B_K_V.shape[-1])
    return torch.gather(logits_B_K_V, 1, index)


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
