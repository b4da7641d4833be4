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


def read_frame(
    source: str, split: str = "train", setting_name: str = "data.source", holds: str = "prompts"
) -> pd.DataFrame:
    """The rows of a local .jsonl / .json / .csv / .parquet file, or of a Hugging Face dataset's `split`.

    A source that names an existing file, or ends in one of those suffixes, is a local file (a missing one is an
    error, never a hub lookup); anything else is a dataset name. Errors name `setting_name` (the setting that holds
    `source`) and say what the source should have held (`holds`), so each caller's messages point at its own
    setting. Shared by the prompt sources here and the supervised pairs of `core/pairs.py`.
    """
    if source == BUNDLED or source.startswith(BUNDLED + ":"):
        name = source.partition(":")[2] or "prompts.jsonl"
        bundled = resources.files("redteam_grpo.core.resources") / name
        if not name.endswith(".jsonl") or not bundled.is_file():
            names = sorted(
                f.name for f in resources.files("redteam_grpo.core.resources").iterdir() if f.name.endswith(".jsonl")
            )
            raise DataError(
                f"{setting_name} {source!r}: no such bundled file; bundled files: bundled:{', bundled:'.join(names)}"
            )
        with resources.as_file(bundled) as file:
            return _read_local(file, setting_name, holds)
    path = Path(source)
    if path.exists():
        return _read_local(path, setting_name, holds)
    if path.suffix.lower() in LOCAL_SUFFIXES:
        raise DataError(f"{setting_name} {source} does not exist (a local file was meant: check the path)")
    return _read_hub(source, split, setting_name)


def _read_local(path: Path, setting_name: str, holds: str) -> pd.DataFrame:
    readers = {
        ".jsonl": lambda p: pd.read_json(p, lines=True),
        ".json": pd.read_json,
        ".csv": pd.read_csv,
        ".parquet": pd.read_parquet,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{setting_name} {path}: unsupported file type {path.suffix!r} (use .jsonl, .csv or .parquet)")
    if path.is_file() and path.suffix.lower() != ".parquet" and not path.read_bytes().strip():
        raise DataError(f"{setting_name} {path} is empty: it holds no {holds}")
    try:
        return reader(path)
    except ValueError as exc:
        raise DataError(f"{setting_name} {path} could not be read as {path.suffix}: {exc}") from None


def _read_hub(source: str, split: str, setting_name: str) -> pd.DataFrame:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{setting_name} {source!r} looks like a Hugging Face dataset, which needs the `datasets` package: "
            f"pip install datasets (or point {setting_name} at a local .jsonl/.csv/.parquet file)"
        ) from None
    try:
        return datasets.load_dataset(source, split=split).to_pandas()
    except Exception as exc:
        raise DataError(
            f"Hugging Face dataset {source!r} (split {split!r}) could not be loaded: {exc}. Offline runs "
            "need it in the local cache (run.offline=false to download)."
        ) from None


def load_prompts(cfg: DataConfig) -> list[Prompt]:
    frame = read_frame(cfg.source, cfg.split)
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
