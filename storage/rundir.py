"""Run directory layout and the stage manifest.

    runs/<run_id>/
      config.json                 the resolved config (a resumed run must match it)
      manifest.json               completed stages with their files' sha256, run status
      iter_0000/rollouts.parquet  scores.parquet  advantages.parquet  train_metrics.parquet
      checkpoints/init/           the adapter before any update (LoRA init is random)
      checkpoints/iter_0000/      adapter.safetensors optimizer.safetensors rng.safetensors manifest.json

A stage counts as completed only when its files exist with the checksums the manifest recorded after they
were renamed into place; anything else (a missing entry, a `.tmp-` file, a changed file) is recomputed.

A folder is a run once its manifest exists: `create` writes it last. A folder with no manifest that holds only
what an interrupted `create` leaves (config.json, owner.lock, temporary files) is not a run yet; `create` takes
it over and `open` says how to start it again. The process that runs stages owns the folder (owner.lock,
storage/ownership.py).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from redteam_grpo.core.config import Config, ConfigError, config_differences, validate_config
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.atomic import TMP_PREFIX, sha256_file, write_atomic, write_json_atomic
from redteam_grpo.storage.stages import CHECKPOINT, Stage

# The layout this code writes. A run written by an earlier layout is refused with what changed (FORMAT_CHANGES).
RUN_FORMAT = 2
FORMAT_CHANGES = {
    1: (
        "metrics columns renamed (kl_mean -> kl_base_mean, kl_max -> kl_base_max, approx_kl -> sampler_kl, "
        "seconds -> update_seconds; reward_std and ratio_std are now sample stds), KL on the sampling distribution, "
        "and config keys moved (training.kl_beta -> reward.kl_weight, reward.repetition_penalty -> "
        "reward.repetition_weight, reward.refusal_penalty -> reward.refusal_weight; sampling.top_p, top_k, "
        "min_new_tokens, repetition_penalty and backend removed)"
    ),
}
INIT_VERSION = -1  # the policy version (and checkpoint) before the first update
OWNER_FILE = "owner.lock"  # held by the process that runs the stages (storage/ownership.py)
# What a `create` interrupted before its manifest write can leave in the folder.
_CREATION_LEFTOVERS = ("config.json", OWNER_FILE)


def checkpoint_name(version: int) -> str:
    """`init` for the adapter a run starts from, `iter_0007` for the one after iteration 7's update."""
    return "init" if version < 0 else f"iter_{version:04d}"


def _manifest_key(stage: Stage, iteration: int) -> str:
    return f"{iteration}/{stage.name}"


def _parse_manifest_key(key: str) -> tuple[int, str]:
    iteration, _, stage = key.partition("/")
    return int(iteration), stage


def _is_temporary(path: Path) -> bool:
    return path.name.startswith(TMP_PREFIX)


class RunDirError(RuntimeError):
    """A run directory cannot be used as asked; the message says why and what to do."""


def new_run_id(name: str) -> str:
    return f"{name}-{dt.datetime.now(dt.UTC).strftime('%Y%m%d-%H%M%S-%f')}"


@dataclass(frozen=True)
class RunDir:
    root: Path

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

    def checkpoint_dir(self, version: int) -> Path:
        """Checkpoint after iteration `version`'s update; INIT_VERSION (-1) is the initial adapter."""
        return self.root / "checkpoints" / checkpoint_name(version)

    # -- stage tables --------------------------------------------------------------------------------------

    def read(self, stage: Stage, iteration: int) -> pa.Table:
        """The stage's table of `iteration`, its schema checked before any value is used."""
        assert stage.schema is not None
        return schemas.read_table(self.path(stage, iteration), stage.schema)

    def write(self, stage: Stage, iteration: int, table: pa.Table) -> Path:
        """Write the stage's table atomically (a temporary name, then a rename); not yet recorded as done."""
        assert stage.schema is not None
        schemas.check_schema(table.schema, stage.schema, f"{stage.label} of iteration {iteration}")
        path = self.path(stage, iteration)
        write_atomic(path, lambda tmp: pq.write_table(table, tmp))
        return path

    # -- creation and resume -------------------------------------------------------------------------------

    @classmethod
    def root_for(cls, config: Config) -> Path:
        if config.run.run_id is None:
            raise ValueError("the run id is chosen before the folder (new_run_id)")
        return config.run.runs_dir / config.run.run_id

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
            {"run_id": run.run_id, "format_version": RUN_FORMAT, "status": "running", "stages": {}},
        )
        return run

    @classmethod
    def open(cls, root: Path) -> RunDir:
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
        leftovers = [p for p in self.root.rglob(f"{TMP_PREFIX}*") if p.is_file()]
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)

    def check_format(self) -> None:
        """Refuse a run written by another layout, naming what changed."""
        try:
            version = json.loads(self.manifest_path.read_text()).get("format_version", 1)
        except json.JSONDecodeError as exc:
            raise RunDirError(f"{self.manifest_path} is not valid JSON: {exc}") from None
        if version != RUN_FORMAT:
            changes = FORMAT_CHANGES.get(version, "a layout this version does not know")
            raise RunDirError(
                f"{self.root} was written in run format {version}; this version reads format {RUN_FORMAT} "
                f"({changes}). Its Parquet files stay readable with pandas or DuckDB; start a new run to continue."
            )

    def stored_config(self) -> Config:
        try:
            return validate_config(json.loads(self.config_path.read_text()))
        except (json.JSONDecodeError, ConfigError) as exc:
            raise RunDirError(f"{self.config_path} is not a valid config: {exc}") from None

    def check_resume_config(self, requested: Config | None, allowed_prefixes: tuple[str, ...]) -> Config:
        """The config to resume with: the stored one, or `requested` if it differs only in allowed fields."""
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
        if differing:
            write_json_atomic(self.config_path, requested.model_dump(mode="json"))
        return requested

    # -- manifest ------------------------------------------------------------------------------------------

    _lock = threading.Lock()

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text())

    def _update_manifest(self, change) -> None:
        with self._lock:
            data = self.manifest()
            change(data)
            write_json_atomic(self.manifest_path, data)

    def record_done(self, stage: Stage, iteration: int, files: list[Path], **info: Any) -> None:
        """Record the stage of `iteration` as completed, with the sha256 of each file it wrote."""
        entry = {
            "files": {str(p.relative_to(self.root)): sha256_file(p) for p in files},
            "completed_at": dt.datetime.now(dt.UTC).isoformat(),
            **info,
        }
        key = _manifest_key(stage, iteration)
        self._update_manifest(lambda data: data["stages"].__setitem__(key, entry))

    def completed(self, stage: Stage, iteration: int) -> dict[str, Any] | None:
        """The manifest entry if the stage of `iteration` completed and its files are intact, else None."""
        entry = self.manifest()["stages"].get(_manifest_key(stage, iteration))
        if entry is None:
            return None
        for rel, digest in entry["files"].items():
            path = self.root / rel
            if not path.is_file() or sha256_file(path) != digest:
                return None
        return entry

    def recorded_iterations(self, stage: Stage) -> list[int]:
        """Iterations whose `stage` the manifest records as completed (files not re-checked), in order."""
        keys = (_parse_manifest_key(k) for k in self.manifest()["stages"])
        return sorted(iteration for iteration, name in keys if name == stage.name)

    def recorded_files(self, stage: Stage) -> list[Path]:
        """The stage's files of every iteration the manifest records as completed, in iteration order."""
        return [self.path(stage, i) for i in self.recorded_iterations(stage)]

    def set_status(self, status: str, **info: Any) -> None:
        self._update_manifest(lambda data: data.update(status=status, **info))

    def completed_iterations(self) -> list[int]:
        """Iterations whose checkpoint is sealed."""
        return self.recorded_iterations(CHECKPOINT)

    def newest_checkpoint(self) -> int | None:
        """The newest iteration whose checkpoint is sealed and intact; None if there is none."""
        for iteration in reversed(self.completed_iterations()):
            try:
                checkpoints.read_manifest(self.checkpoint_dir(iteration))
            except checkpoints.CheckpointError:
                continue
            return iteration
        return None

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
            raise RunDirError(f"{exc}; completed checkpoints: {done}") from None
        return iteration
