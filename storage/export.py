"""Write a table of adversarial examples (or any query result) as Parquet, JSONL, CSV, JSON or a Hugging Face
`datasets` folder, all-or-nothing: a temporary name, then a rename."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from redteam_grpo.storage.atomic import temporary_folder, write_atomic
from redteam_grpo.storage.location import is_remote

FILE_FORMATS = {"parquet", "jsonl", "json", "csv"}


class ExportError(ValueError):
    """An export cannot be written as asked."""


def csv_ready(df: pd.DataFrame) -> pd.DataFrame:
    """List cells (judge categories, token ids) as JSON text: pandas would write numpy's `['a' 'b']`."""

    def as_json(value):
        if isinstance(value, list | tuple | np.ndarray):
            return json.dumps([v.item() if isinstance(v, np.generic) else v for v in value])
        return value

    listy = [c for c in df.columns if df[c].map(lambda v: isinstance(v, list | tuple | np.ndarray)).any()]
    return df.assign(**{c: df[c].map(as_json) for c in listy}) if listy else df


def write_frame(df: pd.DataFrame, path: Path, fmt: str) -> Path:
    """One file in `fmt`; lists (judge categories) stay lists in Parquet/JSON and become JSON text in CSV."""
    if fmt not in FILE_FORMATS:
        raise ExportError(f"unknown format {fmt!r}: use one of {', '.join(sorted(FILE_FORMATS))}")
    writers = {
        "parquet": lambda tmp: df.to_parquet(tmp, index=False),
        "jsonl": lambda tmp: df.to_json(tmp, orient="records", lines=True, force_ascii=False),
        "json": lambda tmp: df.to_json(tmp, orient="records", force_ascii=False, indent=1),
        "csv": lambda tmp: csv_ready(df).to_csv(tmp, index=False),
    }
    write_atomic(path, writers[fmt])
    return path


def require_datasets():
    try:
        import datasets
    except ImportError:
        raise ExportError("a Hugging Face dataset folder needs `pip install datasets`") from None
    return datasets


def write_hf_dataset(df: pd.DataFrame, folder: Path) -> Path:
    """A `datasets.Dataset.save_to_disk` folder (load it with `datasets.load_from_disk`)."""
    datasets = require_datasets()
    if is_remote(folder):
        raise ExportError(
            f"a Hugging Face dataset folder is written on a local disk, not at {folder}: give --out a folder"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(folder)
    try:
        datasets.Dataset.from_pandas(df, preserve_index=False).save_to_disk(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
