"""The finished parts of one evaluation, so that an interrupted evaluation resumes where it stopped.

An evaluation samples and scores part after part (a policy's answers to one set, an attacker's prompts): minutes each
on a real model. Each part is written, atomically, as a Parquet file of its rows under its schema, in
`RUN/eval/<rows file stem>.parts/`, beside the settings the evaluation runs with (its options and a digest of every
checkpoint it reads). Rerun with the same settings, the evaluation reads the parts it finished instead of sampling
them again; with other settings (or a checkpoint rewritten since) the parts are discarded first. Once the rows file
and its summary are written, the folder is removed. A part is read back through its schema, and a fresh part is
returned as read back too, so that what follows sees the same values whether a part was resumed or not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.location import remove_tree

SETTINGS_FILE = "settings.json"


def checkpoint_digest(folder: Path) -> str:
    """A checkpoint's identity: the sha256 of its manifest, which holds the sha256 of every file it seals."""
    return hashlib.sha256((folder / checkpoints.MANIFEST_FILE).read_bytes()).hexdigest()


def digest_of(values: Any) -> str:
    """The sha256 of `values` as JSON: what a part was computed from (a prompt set's ids and texts), for the
    settings, so that a file edited under the same name is seen."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def part_file_name(name: str) -> str:
    """A part's file name: its name where it is a plain one (`round1.benign`), else a readable stem and a digest,
    so that no name leaves the parts folder whatever it holds."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip("._") or "part"
    if stem != name:
        stem += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return stem + ".parquet"


class EvaluationParts:
    """The parts folder of the evaluation whose rows go to `rows_path`, for `settings` (JSON values)."""

    def __init__(self, rows_path: Path, settings: dict[str, Any]):
        self.folder = rows_path.with_name(rows_path.stem + ".parts")
        self.resumed: list[str] = []  # the parts read back rather than computed, in order
        self.discarded = False  # parts of other settings were found and removed
        settings_path = self.folder / SETTINGS_FILE
        text = json.dumps(settings, sort_keys=True, indent=1)
        if self.folder.exists():
            try:
                same = settings_path.read_text() == text
            except OSError:
                same = False
            if not same:
                remove_tree(self.folder)
                self.discarded = True
        if not self.folder.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(settings_path, lambda tmp: Path(tmp).write_text(text))

    def rows(self, name: str, schema: pa.Schema, compute: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """The part `name`'s rows: read back if it was finished before, else computed, written, and read back."""
        path = self.folder / part_file_name(name)
        if path.exists():
            try:
                rows = schemas.read_table(path, schema).to_pylist()
            except schemas.SchemaError:
                path.unlink()  # damaged, or of an older schema: computed again
            else:
                self.resumed.append(name)
                return rows
        table = schemas.rows_to_table(compute(), schema, f"the evaluation part {name!r}")
        write_atomic(path, lambda tmp: pq.write_table(table, tmp))
        return table.to_pylist()

    def finish(self) -> None:
        """The evaluation's files are written: its parts are no longer needed."""
        remove_tree(self.folder)
