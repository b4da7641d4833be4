"""Prompt sources: the bundled toy prompts, local JSONL / CSV / Parquet, or a Hugging Face dataset.

Every source becomes a list of `Prompt(prompt_id, text)`; ids are stable (a column, or a hash of the text),
so a row of any stage can be joined back to its prompt across runs.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl

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
    behavior: str | None = None
    """A contextual behavior's request without its context (`text` holds both, as HarmBench's test cases do)."""
    context: str | None = None
    """That behavior's context string (HarmBench's ContextString), which its classifier reads apart."""


def read_frame(
    source: str,
    split: str | None = "train",
    setting_name: str = "data.source",
    holds: str = "prompts",
    subset: str | None = None,
) -> pd.DataFrame:
    """The rows of a local .jsonl / .json / .csv / .parquet file, or of a Hugging Face dataset's `split`.

    A source that names an existing file, or ends in one of those suffixes, is a local file (a missing one is an
    error, never a hub lookup); anything else is a dataset name, read with its `subset` (the dataset's
    configuration, e.g. `standard` of walledai/HarmBench) and `split` (None: the dataset's only split, else
    `train`). Errors name `setting_name` (the setting that holds `source`) and say what the source should have held
    (`holds`), so each caller's messages point at its own setting. Shared by the prompt sources here, the
    supervised pairs of `core/data/pairs.py` and the evaluation sets (`read_source`).
    """
    if not is_local(source):
        return _read_hub(source, split, setting_name, subset)
    if _is_bundled(source):
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
    if not path.exists():
        raise DataError(f"{setting_name} {source} does not exist (a local file was meant: check the path)")
    return _read_local(path, setting_name, holds)


def is_local(source: str) -> bool:
    """Whether `read_frame` reads `source` from a file (bundled, existing, or named with a file suffix) rather than
    from the hub: the one place that tells them apart."""
    path = Path(source)
    return _is_bundled(source) or path.exists() or path.suffix.lower() in LOCAL_SUFFIXES


def _is_bundled(source: str) -> bool:
    return source == BUNDLED or source.startswith(BUNDLED + ":")


SOURCE_OPTIONS = ("subset", "split", "column", "response_column", "id_column", "context_column")


@dataclass(frozen=True)
class SourceSpec:
    """A data set named in one string, `SOURCE?option=value&...`, so that one CLI option or flow parameter can say
    which subset, split, columns and rows of a hub dataset or file to read.

    `subset` and `split` (hub datasets only), `column` (the prompt text), `response_column` (a reference reply),
    `id_column`, `context_column` (a contextual behavior's context string: the prompt is then
    `CONTEXT\\n\\n---\\n\\nBEHAVIOR`, as HarmBench's test cases put it, and HarmBench's classifier reads the two
    apart in its contextual prompt); any other key keeps only the rows whose column of that name holds the value,
    compared as text (a key given twice keeps rows holding either value). Examples:
    `walledai/HarmBench?subset=standard`, `walledai/XSTest?label=safe` (over-refusal needs XSTest's safe prompts only),
    `harmbench_behaviors_text_all.csv?column=Behavior&FunctionalCategory=standard`,
    `walledai/HarmBench?subset=contextual&context_column=context`.
    """

    source: str
    subset: str | None = None
    split: str | None = None
    column: str | None = None
    response_column: str | None = None
    id_column: str | None = None
    context_column: str | None = None
    where: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())


def parse_source(text: str, setting_name: str) -> SourceSpec:
    """`text` as a `SourceSpec`; a malformed option list or an option given twice is a `DataError`.

    >>> spec = parse_source("walledai/XSTest?split=test&label=safe", "--benign")
    >>> spec.source, spec.split, spec.where
    ('walledai/XSTest', 'test', (('label', ('safe',)),))
    """
    source, _, query = text.partition("?")
    example = f"{source or 'NAME'}?split=test&label=safe"
    if not source.strip():
        raise DataError(f"{setting_name} {text!r} names no source before '?' (e.g. {example})")
    try:
        items = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise DataError(
            f"{setting_name} {text!r}: what follows '?' must be key=value pairs joined by '&' (e.g. {example}); "
            f"the keys are {', '.join(SOURCE_OPTIONS)}, or a column whose value keeps a row"
        ) from None
    options: dict[str, str] = {}
    where: dict[str, list[str]] = {}
    for key, value in items:
        if key in SOURCE_OPTIONS:
            if key in options:
                raise DataError(f"{setting_name} {text!r} gives {key} twice: give it once")
            if not value:
                raise DataError(f"{setting_name} {text!r} gives an empty {key}: name one, or leave the option out")
            options[key] = value
        else:
            where.setdefault(key, []).append(value)
    return SourceSpec(source, **options, where=tuple((key, tuple(values)) for key, values in where.items()))


def read_source(spec: SourceSpec, setting_name: str, holds: str = "prompts") -> pd.DataFrame:
    """The rows of `spec`'s source that its filters keep (the index renumbered from 0).

    A filter on a column the source lacks, or filters that keep no row, are errors that list what the source has,
    so a misspelt option or value is never read as "no rows" or as every row.
    """
    given = [name for name in ("subset", "split") if getattr(spec, name) is not None]
    if given and is_local(spec.source):
        raise DataError(
            f"{setting_name} {spec.source}: {' and '.join(given)} apply to Hugging Face datasets only; a local or "
            "bundled file is read whole (filter its rows with ?COLUMN=VALUE)"
        )
    frame = read_frame(spec.source, spec.split, setting_name, holds, subset=spec.subset)
    for column, values in spec.where:
        if column not in frame.columns:
            raise DataError(
                f"{setting_name} {spec.source}: ?{column}=... keeps rows by a column {column!r}, which it lacks; its "
                f"columns are {list(frame.columns)}, and the options are {', '.join(SOURCE_OPTIONS)}"
            )
        text = frame[column].astype(str)  # one conversion for the match and for the values an error lists
        kept = frame[text.isin(values)]
        if kept.empty:
            present = sorted(set(text))
            shown = ", ".join(present[:10]) + (", ..." if len(present) > 10 else "")
            raise DataError(
                f"{setting_name} {spec.source}: no row has {column} = {' or '.join(values)}; its values are {shown}"
            )
        frame = kept
    return frame.reset_index(drop=True)


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


def _read_hub(source: str, split: str | None, setting_name: str, subset: str | None = None) -> pd.DataFrame:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{setting_name} {source!r} looks like a Hugging Face dataset, which needs the `datasets` package: "
            f"pip install datasets (or point {setting_name} at a local .jsonl/.csv/.parquet file)"
        ) from None
    named = f"{source!r}" + (f" (subset {subset!r})" if subset else "")
    try:
        args = (source,) if subset is None else (source, subset)
        loaded = datasets.load_dataset(*args) if split is None else datasets.load_dataset(*args, split=split)
    except Exception as exc:
        raise DataError(
            f"Hugging Face dataset {named}, split {split or 'any'}, could not be loaded: {exc}. A dataset with "
            "several subsets needs one named (?subset=NAME, or data.subset); offline runs need the dataset in the "
            "local cache (run.offline=false to download)."
        ) from None
    if split is None:  # a DatasetDict: its only split, else `train`
        splits = list(loaded)
        if len(splits) != 1 and "train" not in splits:
            raise DataError(f"Hugging Face dataset {named} has splits {splits}: name one (?split=NAME)")
        loaded = loaded[splits[0] if len(splits) == 1 else "train"]
    return loaded.to_pandas()


def load_prompts(cfg: DataConfig) -> list[Prompt]:
    frame = read_frame(cfg.source, cfg.split, subset=cfg.subset)
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
