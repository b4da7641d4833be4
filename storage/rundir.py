"""Run directory layout and the stage manifest.

    runs/<run_id>/
      config.json                 the resolved config (a resumed run must match it)
      manifest.json               completed stages with their files' sha256, run status
      iter_0000/rollouts.parquet  scores.parquet  advantages.parquet  train_metrics.parquet
      checkpoints/init/           the adapter before any update (LoRA init is random)
      checkpoints/iter_0000/      adapter.safetensors optimizer.safetensors rng.safetensors manifest.json

A stage counts as completed only when its files exist with the checksums the manifest recorded after they
were renamed into place; anything else (a missing entry, a `.tmp-` file, a changed file) is recomputed.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redteam_grpo.core.config import Config, ConfigError, config_differences, validate_config
from redteam_grpo.storage.atomic import sha256_file, write_json_atomic

STAGES = ("sample", "score", "advantage", "train_step", "checkpoint")
STAGE_FILES = {
    "sample": "rollouts.parquet",
    "score": "scores.parquet",
    "advantage": "advantages.parquet",
    "train_step": "train_metrics.parquet",
}


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

    def stage_path(self, iteration: int, stage: str) -> Path:
        return self.iteration_dir(iteration) / STAGE_FILES[stage]

    def checkpoint_dir(self, iteration: int) -> Path:
        """Checkpoint after iteration `iteration`'s update; -1 is the initial adapter."""
        return self.root / "checkpoints" / ("init" if iteration < 0 else f"iter_{iteration:04d}")

    # -- creation and resume -------------------------------------------------------------------------------

    @classmethod
    def create(cls, config: Config) -> RunDir:
        run_id = config.run.run_id or new_run_id(config.run.name)
        root = config.run.runs_dir / run_id
        if root.exists() and any(root.iterdir()):
            raise RunDirError(f"{root} already exists: resume it with --resume {root}, or choose another run.run_id")
        root.mkdir(parents=True, exist_ok=True)
        run = cls(root)
        write_json_atomic(run.config_path, config.model_dump(mode="json"))
        write_json_atomic(run.manifest_path, {"run_id": run_id, "status": "running", "stages": {}})
        return run

    @classmethod
    def open(cls, root: Path) -> RunDir:
        if not (root / "config.json").is_file() or not (root / "manifest.json").is_file():
            raise RunDirError(f"{root} is not a run directory (no config.json / manifest.json)")
        return cls(root)

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

    def mark_stage_done(self, iteration: int, stage: str, files: list[Path], **info: Any) -> None:
        entry = {
            "files": {str(p.relative_to(self.root)): sha256_file(p) for p in files},
            "completed_at": dt.datetime.now(dt.UTC).isoformat(),
            **info,
        }
        self._update_manifest(lambda data: data["stages"].__setitem__(f"{iteration}/{stage}", entry))

    def stage_done(self, iteration: int, stage: str) -> dict[str, Any] | None:
        """The manifest entry if the stage completed and its files are intact, else None."""
        entry = self.manifest()["stages"].get(f"{iteration}/{stage}")
        if entry is None:
            return None
        for rel, digest in entry["files"].items():
            path = self.root / rel
            if not path.is_file() or sha256_file(path) != digest:
                return None
        return entry

    def set_status(self, status: str, **info: Any) -> None:
        self._update_manifest(lambda data: data.update(status=status, **info))

    def completed_iterations(self) -> list[int]:
        stages = self.manifest()["stages"]
        return sorted(int(key.split("/")[0]) for key in stages if key.endswith("/checkpoint"))
