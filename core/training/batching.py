"""Micro-batches for forwards over (prompt + completion) sequences, and gradient checkpointing for the update.

A forward pads every sequence of a micro-batch to its longest, so a batch in sampling order pays for its longest
sequence in every micro-batch. Grouped by length (longest first) and capped by padded tokens, micro-batches of
short sequences hold more of them and compute little padding. The losses sum over the whole batch with weights
fixed before the split (`core/training/loss.py: token_weights`), so how rows are grouped does not change the gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from transformers.modeling_layers import GradientCheckpointingLayer


def micro_batches(
    rows: Sequence[int], lengths: Sequence[int], max_sequences: int, max_tokens: int | None = None
) -> list[list[int]]:
    """`rows` split into micro-batches. Without `max_tokens`: runs of `max_sequences` rows in the given order.
    With it: rows ordered by `lengths[row]`, longest first, each micro-batch at most `max_sequences` rows and at
    most `max_tokens` padded tokens (rows x its longest length); a row longer than `max_tokens` is alone.

    >>> micro_batches([0, 1, 2, 3], [5, 40, 6, 38], max_sequences=4, max_tokens=80)
    [[1, 3], [2, 0]]
    """
    if max_tokens is None:
        return [list(rows[s : s + max_sequences]) for s in range(0, len(rows), max_sequences)]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row in sorted(rows, key=lambda r: -lengths[r]):
        # longest first: the first row of a micro-batch sets its padded width
        if current and (len(current) == max_sequences or longest * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        if not current:
            longest = lengths[row]
        current.append(row)
    if current:
        batches.append(current)
    return batches


def enable_checkpointing(base) -> None:
    """Turn on transformers' activation checkpointing (non-reentrant) by the name the installed version has:
    `activation_checkpointing_enable` since its rename, `gradient_checkpointing_enable` before (5.17 has only that;
    later versions keep it as a deprecated alias that warns)."""
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(base) -> None:
    """`enable_checkpointing` undone, by the same version-dependent name."""
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    else:
        base.gradient_checkpointing_disable()


@contextlib.contextmanager
def checkpointed_layers(model, enabled: bool) -> Iterator[None]:
    """Within the block, the decoder layers of `model` (a transformers model, adapters included) recompute their
    activations in the backward instead of keeping them. transformers checkpoints a layer only in training mode;
    the policy stays in eval mode (dropout off, so logprobs are deterministic), so only the layers themselves are
    flagged as training, not their submodules: no dropout is switched on."""
    if not enabled:
        yield
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"{type(base).__name__} has no layers transformers can checkpoint: "
            "set training.gradient_checkpointing=false"
        )
    enable_checkpointing(base)
    modes = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, mode in zip(layers, modes, strict=True):
            layer.training = mode
        disable_checkpointing(base)
