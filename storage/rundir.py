"""Run directory layout and the stage manifest.

    runs/<run_id>/
      config.json                 the resolved config (a resumed run must match it)
      manifest.json               the run's identity and status, the stages of the iteration in progress
      iter_0000/records.json      a sealed iteration's completed stages with their files' sha256, written once
      iter_0000/rollouts.parquet  scores.parquet  advantages.parquet  train_metrics.parquet
      iter_0000/rollouts-00000-of-00004.parquet ...   runtime.shards=4: one part per shard (the manifest lists them)
      checkpoints/init/           the adapter before any update (LoRA init is random)
      checkpoints/iter_0000/      adapter.safetensors optimizer.safetensors manifest.json

A stage counts as completed only when its files exist with the checksums the manifest recorded after they
were renamed into place; anything else (a missing entry, a `.tmp-` file, a changed file) is recomputed.

A folder is a run once its manifest exists: `create` writes it last. A folder with no manifest that holds only
what an interrupted `create` leaves (config.json, owner.lock, temporary files) is not a run yet; `create` takes
it over and `open` says how to start it again. The process that runs stages owns the folder (owner.lock,
storage/ownership.py).

The records of an iteration move out of manifest.json into the iteration's `records.json` when it is sealed, and
manifest.json keeps only which stages each sealed iteration recorded: what is rewritten after every stage stays the
same size however long the run, and each record is written once (a run format before 12 kept every record in
manifest.json, rewritten after every stage, and copied it whole into every checkpoint: quadratic in the run's
length). Each sealed checkpoint keeps a copy of its own iteration's records and of the run's identity (`RUN_RECORD`
in its manifest), so a damaged manifest.json or records.json is rebuilt from the checkpoints (`rebuild_manifest`,
`redteam-grpo rebuild-manifest RUN`): every iteration up to the newest intact checkpoint is recovered with its
checksums and statistics, the stages after it are computed again by the next resume.
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from redteam_grpo.core.config import Config, ConfigError, config_differences, validate_config
from redteam_grpo.core.names import is_component, is_relative_name
from redteam_grpo.core.training.staleness import INITIAL_VERSION
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.atomic import TMP_PREFIX, sha256_file, write_atomic, write_json_atomic
from redteam_grpo.storage.location import is_remote, location, version_of
from redteam_grpo.storage.modes import MODES, mode_of
from redteam_grpo.storage.stages import ALL_STAGES, BY_NAME, CHECKPOINT, Stage

# The layout this code writes. A run written by an earlier layout is refused with what changed (FORMAT_CHANGES).
RUN_FORMAT = 14
FORMAT_CHANGES = {
    13: (
        "a judge stage (judgements.parquet) before the score stage holds what the scorer read from the texts alone "
        "(harm, categories, refusal, novelty), so one step off-policy judges the next iteration beside the update"
    ),
    12: (
        "train_metrics.parquet gained staleness: the updates between the weights that drew the batch and the "
        "trainer's (training.max_staleness)"
    ),
    11: (
        "a sealed iteration's stage records moved from manifest.json to its iter_NNNN/records.json, and a checkpoint "
        "keeps a copy of its own iteration's records only"
    ),
    10: (
        "train_metrics.parquet gained the first-update check's gates (sampler_kl_first_token, _last_token, "
        "_turn_boundary, _sequence, each with its _bound) and varentropy; the bound follows the varentropy of the "
        "distribution the tokens were drawn from"
    ),
    9: (
        "train_metrics.parquet gained sampler_kl_tolerance: the first-update check's bound, by default derived from "
        "the model's layers and logit variance as well as its dtype"
    ),
    8: (
        "the scorer's score is named harm in every mode: scores.parquet toxicity -> harm, turn_toxicity -> "
        "turn_harm; evaluation toxicity -> harm; metrics toxicity_mean -> harm_mean, refusal_share_of_toxic -> "
        "refusal_share_of_harmful; reward.toxicity_weight -> reward.harm_weight"
    ),
    7: (
        "train_metrics.parquet gained correction_token_share and correction_sequence_share; training.ratio_tolerance "
        "became training.first_update_kl_tolerance (a KL, derived from model.dtype) and training.truncated_is_cap "
        "training.mismatch_correction"
    ),
    6: "scores.parquet gained turn_toxicity and turn_rewards, advantages.parquet turn_advantages (dialogue.rewards)",
    5: "rollouts.parquet and attacks.parquet gained turn and speaker (dialogue.turns: one row per sampled message)",
    4: ("scores.parquet gained scorer_truncated, the sample and score stages may be split into parts (runtime.shards)"),
    3: (
        "train_metrics.parquet gained logprob_mismatch_mean, _max and _share (trainer vs sampler logprobs), and the "
        "sampler draws each token itself (other samples for the same seed)"
    ),
    2: "scores.parquet gained the entropy column (the defense reward's entropy term) and run.mode was added",
    1: (
        "metrics columns renamed (kl_mean -> kl_base_mean, kl_max -> kl_base_max, approx_kl -> sampler_kl, "
        "seconds -> update_seconds; reward_std and ratio_std are now sample stds), KL on the sampling distribution, "
        "and config keys moved (training.kl_beta -> reward.kl_weight, reward.repetition_penalty -> "
        "reward.repetition_weight, reward.refusal_penalty -> reward.refusal_weight; sampling.top_p, top_k, "
        "min_new_tokens, repetition_penalty and backend removed)"
    ),
}
INIT_VERSION = INITIAL_VERSION  # the policy version (and checkpoint) before the first update
SAMPLER_FOLDER = "sampler"  # sampling.backend=vllm: adapters exported for the server; derived from the checkpoints
OWNER_FILE = "owner.lock"  # held by the process that runs the stages (storage/ownership.py)
DERIVED_FILE = "derived.lock"  # held by what writes evaluations, exports and reports into the run
# What a `create` interrupted before its manifest write can leave in the folder.
_CREATION_LEFTOVERS = ("config.json", OWNER_FILE)
RUN_RECORD = "run_record"  # a checkpoint manifest's copy of its iteration's records and the run's identity
RECORDS_FILE = "records.json"  # a sealed iteration's stage records, in its folder
# What the manifest says of the run's state rather than of its files: not copied into checkpoints, set by a resume.
_STATE_KEYS = ("status", "shards", "stop_kind", "stop_reason", "interrupted_by", "rebuilt_from", "sealed")


def command_for(root: Path) -> str:
    """The CLI command that runs and resumes the run in `root`, by its config's run.mode; `run` when the config cannot
    be read (a hint must not fail: it still names the folder)."""
    try:
        mode = json.loads((root / "config.json").read_text()).get("run", {}).get("mode", "attack")
    except (OSError, ValueError, AttributeError):
        return "run"
    return MODES[mode].command if mode in MODES else "run"


def checkpoint_name(version: int) -> str:
    """`init` for the adapter a run starts from, `iter_0007` for the one after iteration 7's update."""
    return "init" if version < 0 else f"iter_{version:04d}"


def parse_redo(text: str) -> tuple[Stage, int]:
    """`7` (all of iteration 7) or `7/score` (iteration 7 from its score stage on) as (stage, iteration)."""
    number, _, name = text.partition("/")
    stage = BY_NAME.get(name or ALL_STAGES[0].name)  # the first stage of any mode: the whole iteration
    if not number.strip().isdigit() or stage is None:
        raise RunDirError(
            f"--redo {text!r} is not ITERATION or ITERATION/STAGE: e.g. --redo 7 or --redo 7/train_step "
            f"(stages: {', '.join(s.name for s in ALL_STAGES)})"
        )
    return stage, int(number)


def _manifest_key(stage: Stage, iteration: int) -> str:
    return f"{iteration}/{stage.name}"


_STAGE_ORDER = {s.name: position for position, s in enumerate(ALL_STAGES)}


def _pipeline_order(key: str) -> tuple[int, int]:
    """(iteration, position of the stage in the iteration): the order stages run in."""
    iteration, name = _parse_manifest_key(key)
    return iteration, _STAGE_ORDER[name]


def _parse_manifest_key(key: str) -> tuple[int, str]:
    iteration, _, stage = key.partition("/")
    return int(iteration), stage


def _read_records(
    path: Path, check: Callable[[dict[str, Any]], None], way_out: str, missing: bool = False
) -> dict[str, Any]:
    """A records file (manifest.json, an iteration's records.json): a JSON object with a 'stages' object that passes
    `check` and names no path outside the run; else a DamagedRunError naming the file, what is wrong and `way_out`."""
    try:
        if missing:
            raise ValueError("it is missing")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("stages"), dict):
            raise ValueError("not an object with a 'stages' object")
        check(data)
        _check_names(data)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise DamagedRunError(f"{path} is damaged ({exc}): {way_out}") from None
    return data


def _stage_names(records: dict[str, Any]) -> tuple[str, ...]:
    """The stages an iteration's records hold, in pipeline order."""
    return tuple(sorted({_parse_manifest_key(key)[1] for key in records}, key=_STAGE_ORDER.__getitem__))


def _sealed_index(manifest: dict[str, Any]) -> dict[int, tuple[str, ...]]:
    """manifest.json's 'sealed', by iteration: the stages each sealed iteration recorded. Stored grouped by those
    stages ({"sample score ... checkpoint": [0, 1, ...]}), ~10 bytes an iteration, as they are the same in almost
    every iteration."""
    return {number: tuple(names.split()) for names, numbers in manifest["sealed"].items() for number in numbers}


def _set_sealed(manifest: dict[str, Any], index: dict[int, tuple[str, ...]]) -> None:
    grouped: dict[str, list[int]] = {}
    for number in sorted(index):
        grouped.setdefault(" ".join(index[number]), []).append(number)
    manifest["sealed"] = grouped


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(TMP_PREFIX)


class RunDirError(RuntimeError):
    """A run directory cannot be used as asked; the message says why and what to do."""


class DamagedRunError(RunDirError):
    """A file the manifest records is missing or no longer matches its checksum."""


# sha256 of files already checked by this process, by what changes when the file changes (a local file's path,
# inode, size, mtime and ctime; a remote one's size, modification time and ETag): hashed once per change.
_DIGESTS: dict[tuple[Any, ...], str] = {}
# sealed iterations' records read by this process, by file: (what changes when the file changes, the records)
_RECORDS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}


class WrittenTables:
    """The stage tables this process wrote, by file and what changes when the file changes (`version_of`), so the
    next stages read what the last one wrote from memory, not from Parquet again (~1-3 ms a read, several reads an
    iteration). A file changed since (damaged, rewritten by another process) has another version and is read from
    disk, checked as any other read; a store that reports no version is always read. Arrow tables are immutable, so
    one is shared safely. The newest `max_tables` (a few iterations' files) are kept, within `max_bytes`."""

    def __init__(self, max_bytes: int, max_tables: int) -> None:
        self.max_bytes, self.max_tables = max_bytes, max_tables
        self._tables: OrderedDict[str, tuple[tuple[Any, ...], pa.Table, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the artifact publisher reads from its own thread

    def put(self, path: Path, table: pa.Table) -> None:
        version, size = version_of(path), table.nbytes
        with self._lock:
            self._drop(str(path))
            if not version or size > self.max_bytes:
                return
            self._tables[str(path)] = (version, table, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._tables) > self.max_tables:
                self._drop(next(iter(self._tables)))

    def _drop(self, key: str) -> None:
        found = self._tables.pop(key, None)
        if found is not None:
            self._bytes -= found[2]

    def read(self, path: Path, schema: pa.Schema) -> pa.Table:
        """The file's table: the one written here if the file is still that one, else read (schemas.read_table)."""
        with self._lock:
            found = self._tables.get(str(path))
        if found is not None and found[0] == version_of(path):
            schemas.check_schema(found[1].schema, schema, str(path))
            return found[1]
        return schemas.read_table(path, schema)

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._bytes = 0


WRITTEN_TABLES = WrittenTables(max_bytes=256 * 2**20, max_tables=32)


def file_digest(path: Path) -> str | None:
    """The file's sha256, or None if it does not exist."""
    key = version_of(path)
    if key is None:
        return None
    if not key:  # the store reports nothing that changes with the content: hashed every time
        return sha256_file(path)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(path)
    return _DIGESTS[key]


_REMOTE_SAMPLER_DIRS: dict[str, Path] = {}  # a remote run's local adapter folder, per process


def _check_names(manifest: dict[str, Any]) -> None:
    """Every name the manifest records that becomes a path stays inside the run (core/names.py): a manifest that
    names `../elsewhere` or `/etc/x` as a file, part or parent run is damaged (or crafted), never followed."""
    records = list(manifest.get("stages", {}).values())
    for shards in (manifest.get("shards") or {}).values():
        records += list(shards.values()) if isinstance(shards, dict) else [shards]
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("files", {}), dict):
            raise ValueError(f"a stage record is not an object with a 'files' object: {str(record)[:80]}")
        for name in [*record.get("files", {}), *(record.get("parts") or [])]:
            if not is_relative_name(name):
                raise ValueError(f"it names {name!r} as a file of the run, outside the run's folder")
    for field in ("parent_run", "parent_checkpoint"):
        if manifest.get(field) is not None and not is_component(manifest[field]):
            raise ValueError(f"its {field} {manifest[field]!r} is not one folder name")


def new_run_id(name: str) -> str:
    return f"{name}-{dt.datetime.now(dt.UTC).strftime('%Y%m%d-%H%M%S-%f')}"


@dataclass(frozen=True)
class RebuiltManifest:
    """What `RunDir.rebuild_manifest` recovered: from which checkpoint, which iterations, where the old file went."""

    source: Path | None  # the checkpoint whose copy was used; None: no usable checkpoint, nothing recovered
    iterations: list[int]  # the iterations recorded as complete again
    damaged_copy: Path | None  # the old manifest.json, kept
    skipped: list[str]  # newer checkpoints that could not be used, and why


@dataclass(frozen=True)
class RunDir:
    root: Path  # a local folder or a URL (storage/location.py); a string is taken as either

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", location(self.root))

    @property
    def run_id(self) -> str:
        return self.root.name

    @property
    def config_path(self) -> Path:
        return self.root / "config.json"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def iteration_dir(self, iteration: int) -> Path:
        return self.root / f"iter_{iteration:04d}"

    def path(self, stage: Stage, iteration: int) -> Path:
        """The stage's Parquet file of `iteration`."""
        if stage.file is None:
            raise ValueError(f"stage {stage.name} writes no table")
        return self.iteration_dir(iteration) / stage.file

    @property
    def sampler_dir(self) -> Path:
        """sampling.backend=vllm: where adapters are exported for the server, which loads them from a local folder: the
        run's `sampler/` folder, or a local temporary folder for a run on object storage (they are derived data)."""
        if is_remote(self.root):
            # made here (mkdtemp: a new name, mode 0700), once per run and process: a guessable /tmp path could be
            # planted by another user with weights of their own for the engine to load
            key = str(self.root)
            if key not in _REMOTE_SAMPLER_DIRS:
                _REMOTE_SAMPLER_DIRS[key] = Path(tempfile.mkdtemp(prefix=f"redteam-grpo-sampler-{self.run_id}-"))
            return _REMOTE_SAMPLER_DIRS[key]
        return self.root / SAMPLER_FOLDER

    def checkpoint_dir(self, version: int) -> Path:
        """Checkpoint after iteration `version`'s update; INIT_VERSION (-1) is the initial adapter."""
        return self.root / "checkpoints" / checkpoint_name(version)

    # -- stage tables --------------------------------------------------------------------------------------

    def read(self, stage: Stage, iteration: int) -> pa.Table:
        """The stage's table of `iteration`, checked against the manifest's checksum and its schema before
        any value is used."""
        assert stage.schema is not None
        self.verify(stage, iteration, weights=False)
        return self._read_parts(stage, self.table_paths(stage, iteration))

    def read_part(self, stage: Stage, iteration: int, shard: int, shards: int) -> pa.Table:
        """Shard `shard`'s part of a completed stage's table (checked like `read`): the next stage's shard input."""
        assert stage.schema is not None
        self.verify(stage, iteration, weights=False)
        paths = self.table_paths(stage, iteration)
        if len(paths) != shards:
            raise RunDirError(
                f"{stage.name} of iteration {iteration} was recorded in {len(paths)} parts, not runtime.shards={shards}"
            )
        return WRITTEN_TABLES.read(paths[shard], stage.schema)

    def _read_parts(self, stage: Stage, paths: list[Path]) -> pa.Table:
        assert stage.schema is not None
        tables = [WRITTEN_TABLES.read(path, stage.schema) for path in paths]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def write(self, stage: Stage, iteration: int, table: pa.Table, path: Path | None = None) -> Path:
        """Write the stage's table (or one shard's part of it, at `path`) atomically (a temporary name, then a
        rename); not yet recorded as done."""
        assert stage.schema is not None
        path = path or self.path(stage, iteration)
        schemas.check_schema(table.schema, stage.schema, f"{path.name} of iteration {iteration}")
        write_atomic(path, lambda tmp: pq.write_table(table, tmp))
        WRITTEN_TABLES.put(path, table)
        return path

    # -- shards: one Parquet part per shard, recorded as each completes ------------------------------------

    def part_path(self, stage: Stage, iteration: int, shard: int, shards: int) -> Path:
        """Shard `shard`'s part of the stage's table: `rollouts-00001-of-00004.parquet`; with one shard the
        stage's own file."""
        if shards == 1:
            return self.path(stage, iteration)
        stem = self.path(stage, iteration).name.removesuffix(".parquet")
        return self.iteration_dir(iteration) / f"{stem}-{shard:05d}-of-{shards:05d}.parquet"

    def table_paths(self, stage: Stage, iteration: int) -> list[Path]:
        """The files that hold the stage's table, in shard order: the parts it was recorded with, or its file."""
        entry = self._record(stage, iteration) or {}
        parts = entry.get("parts")
        return [self.root / rel for rel in parts] if parts else [self.path(stage, iteration)]

    def record_part(self, stage: Stage, iteration: int, shard: int, path: Path, rows: int) -> None:
        """Record one shard's part as completed (its sha256 and rows); the stage is recorded when all are."""
        entry = {
            "files": {str(path.relative_to(self.root)): sha256_file(path)},
            "rows": rows,
            "completed_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        key = _manifest_key(stage, iteration)
        self._update_manifest(
            lambda data: data.setdefault("shards", {}).setdefault(key, {}).__setitem__(str(shard), entry)
        )

    def completed_part(self, stage: Stage, iteration: int, shard: int) -> dict[str, Any] | None:
        """The record of a shard's part if it completed and its file is intact, else None (computed again)."""
        entry = self._run_file().get("shards", {}).get(_manifest_key(stage, iteration), {}).get(str(shard))
        return entry if entry is not None and self._intact(entry) else None

    def read_parts(self, stage: Stage, iteration: int, shards: int) -> tuple[pa.Table, list[Path]]:
        """The stage's `shards` recorded, intact parts as one table, and their paths (before the stage itself is
        recorded)."""
        paths = [self.part_path(stage, iteration, k, shards) for k in range(shards)]
        for shard, path in enumerate(paths):
            if self.completed_part(stage, iteration, shard) is None:
                raise DamagedRunError(
                    f"{path} is not a recorded, intact part of {stage.name} of iteration {iteration}: resume the run "
                    f"(redteam-grpo {self.command} --resume {self.root}) to compute it again"
                )
        return self._read_parts(stage, paths), paths

    # -- creation and resume -------------------------------------------------------------------------------

    @classmethod
    def root_for(cls, config: Config) -> Path:
        if config.run.run_id is None:
            raise ValueError("the run id is chosen before the folder (new_run_id)")
        return location(config.run.runs_dir) / config.run.run_id

    @classmethod
    def check_creatable(cls, root: Path) -> None:
        """Refuse a folder that holds a run, or anything but the leftovers of an interrupted creation."""
        if not root.exists():
            return
        if (root / "manifest.json").exists():
            raise RunDirError(f"{root} already exists: resume it with --resume {root}, or choose another run.run_id")
        others = [p.name for p in root.iterdir() if p.name not in _CREATION_LEFTOVERS and not _is_temporary(p)]
        if others:
            raise RunDirError(f"{root} exists and is not a run directory ({', '.join(sorted(others)[:3])}...)")

    @classmethod
    def create(cls, config: Config) -> RunDir:
        """A new run in `runs_dir/run_id`: the config, then the manifest, written last, that makes it a run.

        A folder left by a creation interrupted before its manifest write is taken over (its config replaced).
        """
        if config.run.run_id is None:
            config = config.model_copy(
                update={"run": config.run.model_copy(update={"run_id": new_run_id(config.run.name)})}
            )
        root = cls.root_for(config)
        cls.check_creatable(root)
        root.mkdir(parents=True, exist_ok=True)
        run = cls(root)
        run.remove_temporary_files()
        write_json_atomic(run.config_path, config.model_dump(mode="json"))
        write_json_atomic(
            run.manifest_path,
            {"run_id": run.run_id, "format_version": RUN_FORMAT, "status": "running", "stages": {}, "sealed": {}},
        )
        return run

    @classmethod
    def open(cls, root: str | Path) -> RunDir:
        root = location(root)
        if (root / "config.json").is_file() and not (root / "manifest.json").exists():
            raise RunDirError(
                f"{root} was never started: its creation was interrupted before manifest.json was written. "
                f"Start it again with: redteam-grpo run --config {root / 'config.json'}"
            )
        if not (root / "config.json").is_file() or not (root / "manifest.json").is_file():
            raise RunDirError(f"{root} is not a run directory (no config.json / manifest.json)")
        run = cls(root)
        run.check_format()
        return run

    def remove_temporary_files(self) -> int:
        """Delete what interrupted atomic writes left (TMP_PREFIX names only); the number removed.

        Only for the owner of the run (storage/ownership.py): another process's temporary file may be live.
        """
        leftovers = [p for p in self.root.glob(f"**/{TMP_PREFIX}*") if p.is_file()]
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)

    def check_format(self) -> None:
        """Refuse a run written by another layout, naming what changed."""
        version = self._run_file().get("format_version", 1)
        if version != RUN_FORMAT:
            changes = FORMAT_CHANGES.get(version, "a layout this version does not know")
            raise RunDirError(
                f"{self.root} was written in run format {version}; this version reads format {RUN_FORMAT} "
                f"({changes}). Its Parquet files stay readable with pandas or DuckDB; start a new run to continue."
            )

    @property
    def command(self) -> str:
        """The CLI command that runs (and resumes) this run's mode."""
        return command_for(self.root)

    @property
    def update_stage(self) -> Stage:
        """The stage that writes an iteration's (first) weights: the SFT epoch, or the GRPO train step."""
        return self.update_stages[0]

    @property
    def update_stages(self) -> tuple[Stage, ...]:
        """Every stage that writes weights into an iteration's checkpoint folder (self-play: both roles')."""
        cfg = self.stored_config()
        return mode_of(cfg).update_stages(cfg)

    def stored_config(self) -> Config:
        try:
            return validate_config(json.loads(self.config_path.read_text()))
        except (json.JSONDecodeError, ConfigError) as exc:
            raise RunDirError(f"{self.config_path} is not a valid config: {exc}") from None

    def check_resume_config(self, requested: Config | None, allowed_prefixes: tuple[str, ...]) -> Config:
        """The config to resume with: the stored one, or `requested` if it differs only in allowed fields. Nothing is
        written: `store_resumed_config` does, once every other check of the resume has passed."""
        stored = self.stored_config()
        if requested is None:
            return stored
        # Where the run lives is not part of what it computes.
        requested = requested.model_copy(
            update={
                "run": requested.run.model_copy(update={"runs_dir": stored.run.runs_dir, "run_id": stored.run.run_id})
            }
        )
        differing = config_differences(stored, requested)
        refused = [k for k in differing if not k.startswith(allowed_prefixes)]
        if refused:
            raise RunDirError(
                f"the config differs from the one {self.run_id} was started with in: {', '.join(refused)}. "
                f"Resume without --config/--set (or change only {', '.join(allowed_prefixes)}), or start a new run."
            )
        return requested if differing else stored

    def store_resumed_config(self, resumed: Config) -> None:
        """Record the config a resume runs with (`check_resume_config`), if it differs from the stored one."""
        if config_differences(self.stored_config(), resumed):
            write_json_atomic(self.config_path, resumed.model_dump(mode="json"))

    # -- manifest ------------------------------------------------------------------------------------------

    _lock = threading.Lock()

    def records_path(self, iteration: int) -> Path:
        """A sealed iteration's stage records (RECORDS_FILE in its folder)."""
        return self.iteration_dir(iteration) / RECORDS_FILE

    def _run_file(self) -> dict[str, Any]:
        """manifest.json as written: the run's identity and status, the records of the iterations not yet sealed
        ('stages'), and which stages each sealed iteration recorded ('sealed': its records are in its records.json)."""

        def check(data: dict[str, Any]) -> None:
            sealed = data.setdefault("sealed", {})
            if not isinstance(sealed, dict) or not all(
                isinstance(numbers, list) and all(type(n) is int for n in numbers) for numbers in sealed.values()
            ):
                raise ValueError("its 'sealed' is not an object of stage lists and their iterations")

        return _read_records(
            self.manifest_path,
            check,
            "it records which stages completed. Rebuild it from the checkpoints (the damaged file is kept beside it): "
            f"redteam-grpo rebuild-manifest {self.root}",
        )

    def _sealed_records(self, iteration: int) -> dict[str, Any]:
        """A sealed iteration's stage records, from its records.json, read again only when the file changes."""
        path = self.records_path(iteration)
        version = version_of(path)
        cached = _RECORDS.get(str(path))
        if version and cached is not None and cached[0] == version:
            return cached[1]

        def check(data: dict[str, Any]) -> None:
            if any(_parse_manifest_key(key)[0] != iteration for key in data["stages"]):
                raise ValueError(f"it records stages of an iteration other than {iteration}")

        data = _read_records(
            path,
            check,
            f"it records which stages of iteration {iteration} completed. Rebuild it from that iteration's "
            f"checkpoint: redteam-grpo rebuild-manifest {self.root}",
            missing=version is None,
        )
        if version:
            _RECORDS[str(path)] = (version, data["stages"])
        return data["stages"]

    def _record(self, stage: Stage, iteration: int) -> dict[str, Any] | None:
        """The record of `stage` of `iteration` (None: not recorded), from the one file that holds it."""
        data = self._run_file()
        if iteration in _sealed_index(data):
            return self._sealed_records(iteration).get(_manifest_key(stage, iteration))
        return data["stages"].get(_manifest_key(stage, iteration))

    def identity_and_status(self) -> dict[str, Any]:
        """manifest.json alone: the run's id, format, status (stop kind and reason, the signal that interrupted it)
        and lineage fields, without reading any sealed iteration's records (what a status or lineage reader needs)."""
        return self._run_file()

    def manifest(self) -> dict[str, Any]:
        """The whole record: manifest.json with every sealed iteration's records back in 'stages' (what `inspect`, the
        report and a resume's check read; a stage reads only the records of the iteration it needs)."""
        data = self._run_file()
        stages: dict[str, Any] = {}
        for number in sorted(_sealed_index(data)):
            stages.update(self._sealed_records(number))
        stages.update(data["stages"])
        return {**data, "stages": stages}

    def record_for_checkpoint(self, iteration: int) -> dict[str, Any]:
        """What iteration's checkpoint keeps of the run's records (`RUN_RECORD`): that iteration's stage records and
        the run's identity (run id, format, lineage), not its state; the same size at every iteration."""
        data = self._run_file()
        own = {k: v for k, v in data["stages"].items() if _parse_manifest_key(k)[0] == iteration}
        return {**{k: v for k, v in data.items() if k not in _STATE_KEYS and k != "stages"}, "stages": own}

    def rebuild_manifest(self) -> RebuiltManifest:
        """Write a new manifest.json (the old one kept as manifest.json.damaged[-N]): the run's identity from the
        newest intact checkpoint's `RUN_RECORD`, and every iteration up to it recorded as sealed, its records.json
        used where intact and written again from its own checkpoint's copy where not. The caller owns the run
        (storage/ownership.py). Status: interrupted (a resume continues it); without any usable checkpoint, a
        manifest that records nothing (a resume starts over)."""
        self.stored_config()  # the mode and stages come from it: a damaged config is named first
        sealed = sorted((p for p in (self.root / "checkpoints").glob("iter_*") if p.is_dir()), reverse=True)
        skipped: list[str] = []
        source, identity = None, {"run_id": self.run_id, "format_version": RUN_FORMAT}
        for folder in sealed:
            try:
                found = checkpoints.read_manifest(folder).get(RUN_RECORD)
            except checkpoints.CheckpointError as exc:
                skipped.append(str(exc))
                continue
            if found is None or found.get("format_version") != RUN_FORMAT:
                skipped.append(f"{folder} was sealed by a version that kept no copy of this run format's records")
                continue
            source, identity = folder, {k: v for k, v in found.items() if k != "stages"}
            break
        index: dict[int, tuple[str, ...]] = {}
        if source is not None:
            for iteration in range(int(source.name.removeprefix("iter_")) + 1):
                records = self._recovered_records(iteration, skipped)
                if records is not None:
                    index[iteration] = _stage_names(records)
        kept = self._keep_damaged(self.manifest_path)
        rebuilt = {
            **identity,
            "status": "interrupted",
            "stages": {},
            "rebuilt_from": str(source.relative_to(self.root)) if source else None,
        }
        _set_sealed(rebuilt, index)
        write_json_atomic(self.manifest_path, rebuilt)
        return RebuiltManifest(source, sorted(index), kept, skipped)

    def _recovered_records(self, iteration: int, skipped: list[str]) -> dict[str, Any] | None:
        """Iteration's records: its records.json if intact and sealed, else its checkpoint's copy written back (the
        damaged file kept beside it); None, with the reason in `skipped`, where neither is left."""
        seal_key = _manifest_key(CHECKPOINT, iteration)
        try:
            records = self._sealed_records(iteration)
            if seal_key in records:
                return records
        except DamagedRunError:
            pass
        folder = self.checkpoint_dir(iteration)
        try:
            copy = checkpoints.read_manifest(folder).get(RUN_RECORD)
        except checkpoints.CheckpointError as exc:
            skipped.append(f"iteration {iteration}: its records.json and its checkpoint are both unusable ({exc})")
            return None
        if copy is None or copy.get("format_version") != RUN_FORMAT:
            skipped.append(f"iteration {iteration}: its records.json is unusable and {folder} keeps no copy of it")
            return None
        sealed_file = folder / checkpoints.MANIFEST_FILE
        records = {
            **copy["stages"],
            seal_key: {
                "files": {str(sealed_file.relative_to(self.root)): sha256_file(sealed_file)},
                "completed_at": dt.datetime.now(dt.UTC).isoformat(),
            },
        }
        self._keep_damaged(self.records_path(iteration))
        write_json_atomic(self.records_path(iteration), {"stages": records})
        return records

    def _keep_damaged(self, path: Path) -> Path | None:
        if not path.exists():
            return None
        kept, n = path.with_name(f"{path.name}.damaged"), 1
        while kept.exists():
            kept, n = path.with_name(f"{path.name}.damaged-{n}"), n + 1
        write_atomic(kept, lambda tmp: tmp.write_bytes(path.read_bytes()))
        return kept

    def _update_manifest(self, change) -> None:
        with self._lock:
            data = self._run_file()
            change(data)
            write_json_atomic(self.manifest_path, data)

    def record_done(
        self, stage: Stage, iteration: int, files: list[Path], parts: list[Path] | None = None, **info: Any
    ) -> None:
        """Record the stage of `iteration` as completed, with the sha256 of each file it wrote; `parts`: the files
        that hold its table, when it was computed in shards (their shard records are folded into this one). The
        checkpoint's record seals the iteration: its records move to its records.json, written once."""
        entry = {
            "files": {str(p.relative_to(self.root)): file_digest(p) or sha256_file(p) for p in files},
            **({"parts": [str(p.relative_to(self.root)) for p in parts]} if parts else {}),
            "completed_at": dt.datetime.now(dt.UTC).isoformat(),
            **info,
        }
        key = _manifest_key(stage, iteration)
        if stage.name == CHECKPOINT.name:
            self._seal(iteration, key, entry)
            return

        def change(data: dict[str, Any]) -> None:
            data["stages"][key] = entry
            data.get("shards", {}).pop(key, None)

        self._update_manifest(change)

    def _seal(self, iteration: int, key: str, entry: dict[str, Any]) -> None:
        """Move iteration's records out of manifest.json into its records.json, written first: a crash between the
        two writes leaves the records in manifest.json, and the checkpoint stage, not recorded, runs again."""
        with self._lock:
            data = self._run_file()
            own = {k: v for k, v in data["stages"].items() if _parse_manifest_key(k)[0] == iteration}
            own[key] = entry
            write_json_atomic(self.records_path(iteration), {"stages": own})
            for k in own:
                data["stages"].pop(k, None)
                data.get("shards", {}).pop(k, None)
            _set_sealed(data, {**_sealed_index(data), iteration: _stage_names(own)})
            write_json_atomic(self.manifest_path, data)

    def completed(self, stage: Stage, iteration: int) -> dict[str, Any] | None:
        """The manifest entry if the stage of `iteration` completed and its files are intact, else None (the
        stage is then computed again)."""
        entry = self._record(stage, iteration)
        return entry if entry is not None and self._intact(entry) else None

    def _intact(self, entry: dict[str, Any]) -> bool:
        """Every file of a manifest record (a stage's or a shard's) has the checksum recorded for it."""
        return all(file_digest(self.root / rel) == digest for rel, digest in entry["files"].items())

    def verify(self, stage: Stage, iteration: int, weights: bool = True) -> dict[str, Any]:
        """The manifest entry of a completed stage whose files are intact; else an error that names the file, what
        depends on it and the command that recomputes it. `weights=False` checks the stage's table only: the
        weights a train step wrote are checked when they are loaded (their checkpoint's manifest), and old ones
        may have been pruned (run.keep_checkpoints)."""
        entry = self._record(stage, iteration)
        if entry is None:
            raise RunDirError(
                f"{stage.name} of iteration {iteration} is not recorded as completed in {self.manifest_path}: "
                f"resume the run (redteam-grpo {self.command} --resume {self.root})"
            )
        tables = set(
            entry.get("parts") or ([str(self.path(stage, iteration).relative_to(self.root))] if stage.file else [])
        )
        for rel, digest in entry["files"].items():
            if not weights and rel not in tables:
                continue
            found = file_digest(self.root / rel)
            if found != digest:
                problem = "is missing" if found is None else "does not match the checksum recorded when it was written"
                raise DamagedRunError(
                    f"{self.root / rel} {problem}: {stage.name} of iteration {iteration} is damaged, and what was "
                    f"computed from it (the later stages of iteration {iteration} and every later iteration) cannot "
                    f"be trusted. Recompute from there with: redteam-grpo {self.command} --resume {self.root} "
                    f"--redo {iteration}/{stage.name}"
                )
        return entry

    def verify_all(self) -> None:
        """Check what a resumed run builds on: every stage table the manifest records, and the weights of the newest
        sealed checkpoint and of any iteration after it. The first damage is an error."""
        newest = max(self.recorded_iterations(self.update_stage), default=-1)  # the newest weights written
        for key in sorted(self.manifest()["stages"], key=_pipeline_order):
            iteration, name = _parse_manifest_key(key)
            self.verify(BY_NAME[name], iteration, weights=iteration >= newest)

    def check_redo(self, stage: Stage, iteration: int) -> None:
        """Refuse a redo whose starting weights are gone (pruned by run.keep_checkpoints, or damaged) before anything
        is dropped, naming the earliest redo that can work."""
        before_update = stage.name != CHECKPOINT.name  # the update stage and those before it start from i - 1
        needed = iteration - 1 if before_update else iteration  # the checkpoint (or weights) the redo starts from
        if needed < 0:
            return  # the initial adapter is written again when missing
        try:
            if before_update:
                checkpoints.read_manifest(self.checkpoint_dir(needed))
            else:
                self.verify(self.update_stage, needed)
        except (checkpoints.CheckpointError, RunDirError):
            kept = [
                i for i in self.completed_iterations() if (self.checkpoint_dir(i) / checkpoints.MANIFEST_FILE).is_file()
            ]
            earliest = f"--redo {kept[0] + 1}" if kept else "--redo 0"
            raise RunDirError(
                f"--redo {iteration}/{stage.name} starts from the weights after iteration {needed}, which are no "
                f"longer intact or were pruned (run.keep_checkpoints); the earliest redo that can work is {earliest}"
            ) from None

    def forget_from(self, stage: Stage, iteration: int) -> list[str]:
        """Drop `stage` of `iteration`, the stages after it and every later iteration from the records, so that a
        resume recomputes them; unseal their checkpoints. Returns the dropped keys."""
        first = (iteration, _STAGE_ORDER[stage.name])
        keys = sorted((k for k in self.manifest()["stages"] if _pipeline_order(k) >= first), key=_pipeline_order)
        for key in keys:
            i, name = _parse_manifest_key(key)
            if name == CHECKPOINT.name:  # a sealed checkpoint must not outlive its record
                (self.checkpoint_dir(i) / checkpoints.MANIFEST_FILE).unlink(missing_ok=True)
        unsealed = sorted(n for n in _sealed_index(self._run_file()) if n >= iteration)
        kept = self._sealed_records(iteration) if iteration in unsealed else {}

        def change(data: dict[str, Any]) -> None:
            _set_sealed(data, {n: names for n, names in _sealed_index(data).items() if n < iteration})
            data["stages"].update({k: v for k, v in kept.items() if _pipeline_order(k) < first})  # open again
            for key in keys:
                data["stages"].pop(key, None)
            shards = data.get("shards", {})
            for key in [k for k in shards if _pipeline_order(k) >= first]:  # parts of a stage still in shards
                del shards[key]
            data.update(status="running")
            data.pop("stop_kind", None)
            data.pop("stop_reason", None)

        self._update_manifest(change)
        for number in unsealed:  # after the manifest stops naming them: a crash in between leaves unused files
            self.records_path(number).unlink(missing_ok=True)
        return keys

    def recorded_iterations(self, stage: Stage) -> list[int]:
        """Iterations whose `stage` is recorded as completed (files not re-checked), in order."""
        data = self._run_file()
        found = {number for number, names in _sealed_index(data).items() if stage.name in names}
        found.update(i for i, name in map(_parse_manifest_key, data["stages"]) if name == stage.name)
        return sorted(found)

    def set_status(self, status: str, **info: Any) -> None:
        self._update_manifest(lambda data: data.update(status=status, **info))

    def completed_iterations(self) -> list[int]:
        """Iterations whose checkpoint is sealed."""
        return self.recorded_iterations(CHECKPOINT)

    def checkpoint_intact(self, iteration: int) -> bool:
        """Whether iteration's checkpoint verifies (its manifest and every file's checksum)."""
        try:
            checkpoints.read_manifest(self.checkpoint_dir(iteration))
        except checkpoints.CheckpointError:
            return False
        return True

    def newest_checkpoint(self) -> int | None:
        """The newest iteration whose checkpoint is sealed and intact; None if there is none."""
        return next((i for i in reversed(self.completed_iterations()) if self.checkpoint_intact(i)), None)

    def checkpoint_to_use(self, iteration: int | None) -> int:
        """`iteration` (default: the newest sealed one) after checking that its checkpoint is intact."""
        done = self.completed_iterations()
        if iteration is None:
            if not done:
                raise RunDirError(f"{self.root} has no completed checkpoint yet")
            iteration = done[-1]
        try:
            checkpoints.read_manifest(self.checkpoint_dir(iteration))
        except checkpoints.CheckpointError as exc:
            intact = [i for i in done if self.checkpoint_intact(i)]
            way_out = "choose one (`evaluate --iteration N`, `infer --checkpoint N`)"
            damaged = [i for i in done if i not in intact]
            if damaged:
                redo = f"redteam-grpo {command_for(self.root)} --resume {self.root} --redo {damaged[0]}/train_step"
                way_out += f"; damaged: {damaged}, each rewritten from the one before by `{redo}`"
            raise RunDirError(f"{exc}; completed checkpoints: {intact}: {way_out}") from None
        return iteration
