"""Checkpoints as safetensors + JSON: loading one never unpickles anything.

A checkpoint folder holds `adapter.safetensors` (LoRA weights), `optimizer.safetensors` (AdamW state: tensors
in the file, hyper-parameters as JSON in its metadata), in defense the attacker's (`attacker.safetensors`, with
self-play `attacker_optimizer.safetensors`), and `manifest.json`, written last with the sha256 of each file: a
folder without a valid manifest is incomplete and is never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE
from redteam_grpo.core.names import is_relative_name
from redteam_grpo.storage.atomic import TMP_PREFIX, sha256_file, write_atomic, write_json_atomic
from redteam_grpo.storage.location import local_copy, location

ADAPTER_FILE = "adapter.safetensors"
ATTACKER_FILE = "attacker.safetensors"  # defense: the attacker's adapter (initial checkpoint; self-play: every one)
ATTACKER_OPTIMIZER_FILE = "attacker_optimizer.safetensors"  # self-play: the attacker's optimizer state
OPTIMIZER_FILE = "optimizer.safetensors"
# each role's adapter and optimizer files in a checkpoint folder
ROLE_FILES: dict[str, tuple[str, str]] = {
    DEFAULT_ROLE: (ADAPTER_FILE, OPTIMIZER_FILE),
    ATTACKER: (ATTACKER_FILE, ATTACKER_OPTIMIZER_FILE),
}
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def save_adapter(path: Path, state: dict[str, torch.Tensor]) -> None:
    """The adapter's weights; refused, with nothing written, when any is NaN or infinite: a checkpoint is what a
    resume, `infer` and `evaluate` trust."""
    bad = [name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise CheckpointError(
            f"not writing {path}: {len(bad)} of the adapter's {len(state)} tensors hold NaN or infinite values "
            f"({bad[0]}, ...). The update that made them should have been refused; lower training.learning_rate "
            "and resume the run from its last checkpoint."
        )
    save_tensors(path, state)


OPTIMIZER_METADATA = "optimizer"  # the metadata entry of an optimizer file: param groups and non-tensor state


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """AdamW state without pickle: per-parameter tensors keyed `state.<index>.<name>`, groups as JSON."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{name}"] = value
            else:
                scalars[f"{index}.{name}"] = value
    # One metadata entry, its JSON keys sorted: safetensors writes a metadata map in hash order, which differs
    # between processes, so two entries made two identical optimizer states different files.
    metadata = {
        OPTIMIZER_METADATA: json.dumps({"param_groups": state["param_groups"], "scalars": scalars}, sort_keys=True)
    }
    if not tensors:  # safetensors cannot store an empty file with metadata only in every version
        tensors["__empty__"] = torch.zeros(0)
    save_tensors(path, tensors, metadata)


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    try:
        with local_copy(path) as file, safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
            names = [k for k in handle.keys() if k != "__empty__"]  # noqa: SIM118 (safe_open is not a dict)
            tensors = {k: handle.get_tensor(k) for k in names}
        if OPTIMIZER_METADATA in metadata:
            groups_and_scalars = json.loads(metadata[OPTIMIZER_METADATA])
        else:  # written before the two entries became one
            groups_and_scalars = {k: json.loads(metadata.get(k, "{}")) for k in ("param_groups", "scalars")}
        param_groups, scalars = groups_and_scalars["param_groups"], groups_and_scalars["scalars"]
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise CheckpointError(f"{path} is not a valid optimizer state: {exc}") from None
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for key, value in scalars.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    current = optimizer.state_dict()
    if len(param_groups) != len(current["param_groups"]) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(param_groups, current["param_groups"], strict=True)
    ):
        raise CheckpointError(f"{path} holds optimizer state for a different set of parameters")
    for group in param_groups:  # JSON turned tuples into lists
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def resolve_adapter_source(source: Path) -> Path:
    """A checkpoint folder, or a run folder (its newest sealed checkpoint), as the folder of an intact checkpoint
    that holds an adapter; CheckpointError naming what is wrong otherwise."""
    source = location(source)
    if (source / MANIFEST_FILE).is_file() and (source / "checkpoints").is_dir():  # a run folder
        sealed = sorted(p for p in (source / "checkpoints").glob("iter_*") if (p / MANIFEST_FILE).is_file())
        if not sealed:
            raise CheckpointError(f"{source} has no sealed checkpoint yet: finish (or resume) that run first")
        source = sealed[-1]
    manifest = read_manifest(source)
    if ADAPTER_FILE not in manifest.get("files", {}):
        raise CheckpointError(f"{source} holds no {ADAPTER_FILE}: give a run folder or a checkpoint folder")
    return source


def write_manifest(folder: Path, info: dict[str, Any]) -> None:
    # A temporary file is an unfinished write (pathlib's `*` matches its leading dot): never part of a checkpoint.
    weights = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith(TMP_PREFIX))
    files = {p.name: sha256_file(p) for p in weights}
    write_json_atomic(folder / MANIFEST_FILE, {"format_version": FORMAT_VERSION, "files": files, **info})


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint, else CheckpointError naming what is wrong."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {manifest.get('format_version')}, expected {FORMAT_VERSION}")
    for name, digest in manifest.get("files", {}).items():
        if not is_relative_name(name):  # core/names.py: a crafted manifest must not make us read outside the folder
            raise CheckpointError(f"{path} names {name!r} as a checkpoint file, outside its folder: it is damaged")
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing from the checkpoint")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{file} does not match its checksum: the checkpoint is corrupt")
    return manifest
