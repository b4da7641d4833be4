"""Prompt sources: the bundled toy prompts, local JSONL / CSV / Parquet, or a Hugging Face dataset.

Every source becomes a list of `Prompt(prompt_id, text)`; ids are stable (a column, or a hash of the text),
so a row of any stage can be joined back to its prompt across runs.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pandas as pd

from redteam_grpo.core.config import DataConfig

BUNDLED = "bundled"
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


class DataError(ValueError):
    """Prompts cannot be loaded; the message names the source and the way out."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str


def _read_local(path: Path) -> pd.DataFrame:
    readers = {
        ".jsonl": lambda p: pd.read_json(p, lines=True),
        ".json": pd.read_json,
        ".csv": pd.read_csv,
        ".parquet": pd.read_parquet,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"data.source {path}: unsupported file type {path.suffix!r} (use .jsonl, .csv or .parquet)")
    if path.is_file() and path.suffix.lower() != ".parquet" and not path.read_bytes().strip():
        raise DataError(f"data.source {path} is empty: it holds no prompts")
    try:
        return reader(path)
    except ValueError as exc:
        raise DataError(f"data.source {path} could not be read as {path.suffix}: {exc}") from None


def _read_hub(cfg: DataConfig) -> pd.DataFrame:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.source {cfg.source!r} looks like a Hugging Face dataset, which needs the `datasets` package: "
            "pip install datasets (or point data.source at a local .jsonl/.csv/.parquet file)"
        ) from None
    try:
        return datasets.load_dataset(cfg.source, split=cfg.split).to_pandas()
    except Exception as exc:
        raise DataError(
            f"Hugging Face dataset {cfg.source!r} (split {cfg.split!r}) could not be loaded: {exc}. Offline runs "
            "need it in the local cache (run.offline=false to download)."
        ) from None


def load_prompts(cfg: DataConfig) -> list[Prompt]:
    path = Path(cfg.source)
    if cfg.source == BUNDLED:
        with resources.as_file(resources.files("redteam_grpo.core.resources") / "prompts.jsonl") as bundled:
            frame = _read_local(bundled)
    elif path.exists():
        frame = _read_local(path)
    elif path.suffix.lower() in LOCAL_SUFFIXES:
        raise DataError(f"data.source {cfg.source} does not exist (a local file was meant: check the path)")
    else:
        frame = _read_hub(cfg)
    if cfg.prompt_column not in frame.columns:
        raise DataError(
            f"data.prompt_column {cfg.prompt_column!r} is not a column of {cfg.source}; its columns are "
            f"{list(frame.columns)}"
        )
    if cfg.id_column is not None and cfg.id_column not in frame.columns:
        raise DataError(f"data.id_column {cfg.id_column!r} is not a column of {cfg.source}: {list(frame.columns)}")
    prompts, seen = [], set()
    for _, row in frame.iterrows():
        text = row[cfg.prompt_column]
        if not isinstance(text, str) or not text.strip() or text in seen:
            continue
        seen.add(text)
        pid = str(row[cfg.id_column]) if cfg.id_column else "h" + hashlib.sha256(text.encode()).hexdigest()[:12]
        prompts.append(Prompt(pid, text))
        if cfg.max_prompts and len(prompts) >= cfg.max_prompts:
            break
    if not prompts:
        raise DataError(f"data.source {cfg.source} holds no non-empty prompts in column {cfg.prompt_column!r}")
    return prompts


def prompts_for_iteration(prompts: list[Prompt], iteration: int, per_iteration: int, seed: int, shuffle: bool):
    """The iteration's prompts: consecutive slices of a seeded permutation, reshuffled each epoch.

    A function of (iteration, seed) only, so a resumed run draws the same prompts it would have drawn.
    """
    chosen = []
    position = iteration * per_iteration
    while len(chosen) < per_iteration:
        epoch, offset = divmod(position, len(prompts))
        order = list(range(len(prompts)))
        if shuffle:
            random.Random(f"{seed}-{epoch}").shuffle(order)
        take = min(per_iteration - len(chosen), len(prompts) - offset)
        chosen.extend(prompts[i] for i in order[offset : offset + take])
        position += take
    return chosen


def check_prompt_lengths(prompts: list[Prompt], prompt_ids: list[list[int]], max_prompt_tokens: int) -> None:
    """Refuse prompts longer than `model.max_prompt_tokens` after chat formatting, naming them."""
    too_long = [p.prompt_id for p, ids in zip(prompts, prompt_ids, strict=True) if len(ids) > max_prompt_tokens]
    if too_long:
        raise DataError(
            f"{len(too_long)} prompts (e.g. {', '.join(too_long[:5])}) exceed model.max_prompt_tokens="
            f"{max_prompt_tokens} after chat formatting: raise model.max_prompt_tokens or filter the data"
        )
