"""Supervised (goal -> adversarial prompt) pairs for the attacker's SFT warm start, and their held-out split.

A pair source is read exactly like a prompt source (`core/data/sources.py: read_frame`: a local .jsonl / .json / .csv /
.parquet file, or a Hugging Face dataset by name), so both accept the same files and fail with the same messages.
Every pair gets a stable id (the id column, else a hash of its input and target), so the SFT's train / eval split
and any row written from a pair can be joined back to the source across runs. The split ranks pairs by a seeded
hash of their ids: it depends on the seed and on which pairs there are, never on the order of the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from redteam_grpo.core.data.sources import BUNDLED, DataError, read_frame

BUNDLED_PAIRS = "bundled:attack_pairs.jsonl"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pair:
    """One supervised example: the attacker reads `input_text` (a goal) and is trained to write `target_text`."""

    pair_id: str
    input_text: str
    target_text: str


def pair_hash_id(input_text: str, target_text: str) -> str:
    """The id of a pair whose source has no id column: a hash of both texts (JSON keeps their boundary unambiguous)."""
    return "h" + hashlib.sha256(json.dumps([input_text, target_text]).encode()).hexdigest()[:12]


# The setting that holds each argument of `load_pairs`, named in its errors (run.mode=sft reads its pairs from the
# data section, the target column from the sft section). A caller with other settings passes `setting_names`.
PAIR_SETTINGS = {
    "source": "data.source",
    "input_column": "data.prompt_column",
    "target_column": "sft.target_column",
    "id_column": "data.id_column",
    "max_pairs": "data.max_prompts",
}


def load_pairs(
    source: str,
    split: str = "train",
    input_column: str = "goal",
    target_column: str = "prompt",
    id_column: str | None = None,
    max_pairs: int | None = None,
    *,
    subset: str | None = None,
    setting_names: Mapping[str, str] | None = None,
) -> list[Pair]:
    """The usable pairs of `source`, in source order.

    Rows whose input or target is missing, not a string or blank are skipped (logged with their count); an exact
    repeat of an earlier (input, target) is dropped. `max_pairs` keeps the first that many usable pairs.
    `bundled` reads the bundled attacker pairs (`bundled:attack_pairs.jsonl`). Errors name the settings of
    `PAIR_SETTINGS`, updated by `setting_names` (argument name -> setting name).
    """
    names = {**PAIR_SETTINGS, **(setting_names or {})}
    if max_pairs is not None and max_pairs <= 0:
        raise DataError(f"{names['max_pairs']} is {max_pairs}: use a positive number, or null for all pairs")
    if source == BUNDLED:  # the bundled prompts are no pairs: the bundled pairs are `bundled:attack_pairs.jsonl`
        source = BUNDLED_PAIRS
    frame = read_frame(source, split, names["source"], holds="pairs", subset=subset)
    columns = list(frame.columns)
    for argument, column in (
        ("input_column", input_column),
        ("target_column", target_column),
        ("id_column", id_column),
    ):
        if column is not None and column not in frame.columns:
            raise DataError(
                f"{names[argument]} {column!r} is not a column of {source}; its columns are {columns}: "
                f"set {names[argument]} to one of them"
            )
    ids = frame[id_column].tolist() if id_column is not None else [None] * len(frame)
    pairs: list[Pair] = []
    seen_texts: set[tuple[str, str]] = set()
    seen_ids: set[str] = set()
    skipped = duplicates = 0
    for input_text, target_text, raw_id in zip(
        frame[input_column].tolist(), frame[target_column].tolist(), ids, strict=True
    ):
        if not _is_text(input_text) or not _is_text(target_text):
            skipped += 1
            continue
        if (input_text, target_text) in seen_texts:
            duplicates += 1
            continue
        if id_column is None:
            pair_id = pair_hash_id(input_text, target_text)
        else:
            pair_id = _id_text(raw_id)
            if pair_id is None:
                skipped += 1
                continue
            if pair_id in seen_ids:
                raise DataError(
                    f"{names['id_column']} {id_column!r} of {source} gives id {pair_id!r} to two different pairs: "
                    f"ids must be unique. Fix the column, or set {names['id_column']}=null to derive ids from the texts"
                )
            seen_ids.add(pair_id)
        seen_texts.add((input_text, target_text))
        pairs.append(Pair(pair_id, input_text, target_text))
        if max_pairs is not None and len(pairs) >= max_pairs:
            break
    if skipped:
        log.warning(
            "%s: skipped %d rows with a missing, non-text or blank %r / %r%s",
            source,
            skipped,
            input_column,
            target_column,
            f" / {id_column!r}" if id_column else "",
        )
    if duplicates:
        log.info("%s: dropped %d exact duplicate pairs", source, duplicates)
    if not pairs:
        raise DataError(
            f"{names['source']} {source} holds no usable pairs: every one of its {len(frame)} rows has a missing or "
            f"blank {' or '.join(repr(c) for c in (input_column, target_column, id_column) if c)}. Check "
            f"{names['input_column']} and {names['target_column']}"
        )
    return pairs


def split_pairs(pairs: list[Pair], eval_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, eval): a seeded held-out split, each list in the order of `pairs`.

    The eval pairs are the round(len * eval_fraction) pairs ranked first by a hash of (seed, pair_id): at least
    one when eval_fraction > 0, and always at least one left to train on. The same seed and the same set of pairs
    give the same split whatever their order; a pair keeps its side when other pairs are added, unless it sits at
    the boundary.
    """
    if not 0.0 <= eval_fraction < 1.0:  # NaN fails this too
        raise DataError(f"eval_fraction is {eval_fraction}: use a fraction in [0, 1) (0 for no held-out pairs)")
    ids = [pair.pair_id for pair in pairs]
    if len(set(ids)) != len(ids):
        repeated = sorted(pair_id for pair_id, count in Counter(ids).items() if count > 1)
        raise DataError(f"pair ids repeat ({repeated[:5]}): a split needs unique ids; load pairs with load_pairs")
    if eval_fraction == 0.0:
        return list(pairs), []
    if len(pairs) < 2:
        raise DataError(
            f"eval_fraction={eval_fraction} holds out pairs, but there are only {len(pairs)}: a split needs at least "
            "2 (one to train on, one to evaluate). Add pairs, or set eval_fraction=0"
        )
    n_eval = min(max(1, round(len(pairs) * eval_fraction)), len(pairs) - 1)
    ranked = sorted(ids, key=lambda pair_id: hashlib.sha256(f"{seed}:{pair_id}".encode()).hexdigest())
    held_out = set(ranked[:n_eval])
    train = [pair for pair in pairs if pair.pair_id not in held_out]
    evaluation = [pair for pair in pairs if pair.pair_id in held_out]
    return train, evaluation


def _is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _id_text(value: object) -> str | None:
    """An id column's value as text; None when missing. A float that holds an integer (pandas reads an integer
    column with a gap as float) is written as that integer, so id 7 stays "7", not "7.0"."""
    if value is None or pd.isna(value):  # None, NaN, pd.NA, NaT
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value)
    return text if text.strip() else None
