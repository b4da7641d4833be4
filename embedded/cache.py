"""The embedded models' cache: names, folders, one build per folder, and the name -> folder resolution.

A default recipe's build is the shipped one (`shipped.py`: the same weights on every machine), copied into the
cache after its checksums are checked; any other recipe is trained on the machine.

Each build writes into a temporary folder and renames it into place under a file lock, so concurrent first uses
build once and a crash never leaves a half-built cache. The policy and classifier share one folder
(`ASSETS_VERSION`); the guard (`GUARD_VERSION`) and the defense base (`SAFE_VERSION`) have their own, so a run
with the classifier never pays for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from redteam_grpo.embedded import shipped
from redteam_grpo.embedded.classifier import build_classifier
from redteam_grpo.embedded.guard import build_embedded_guard as train_embedded_guard
from redteam_grpo.embedded.policy import build_policy
from redteam_grpo.embedded.recipes import (
    ASSETS_VERSION,
    DEFAULT_GUARD_RECIPE,
    DEFAULT_RECIPE,
    DEFAULT_SAFE_RECIPE,
    GUARD_VERSION,
    SAFE_VERSION,
    BuildRecipe,
    GuardRecipe,
    SafeRecipe,
)
from redteam_grpo.embedded.safe_policy import build_safe_policy
from redteam_grpo.embedded.training import isolated_build

log = logging.getLogger(__name__)

EMBEDDED_POLICY = "embedded:tiny-qwen3"
EMBEDDED_CLASSIFIER = "embedded:tiny-toxicity"
EMBEDDED_GUARD = "embedded:tiny-guard"
EMBEDDED_SAFE_POLICY = "embedded:tiny-qwen3-safe"
_EMBEDDED_NAMES = (EMBEDDED_POLICY, EMBEDDED_CLASSIFIER, EMBEDDED_GUARD, EMBEDDED_SAFE_POLICY)
# The cache folder of each default build, which is also its name in `embedded/shipped/`.
ASSETS_FOLDER = f"embedded-{ASSETS_VERSION}"
GUARD_FOLDER = f"embedded-guard-{GUARD_VERSION}"
SAFE_FOLDER = f"embedded-safe-{SAFE_VERSION}"


@dataclass(frozen=True)
class EmbeddedAssets:
    policy_dir: Path
    classifier_dir: Path


def build_embedded_assets(out_dir: Path, recipe: BuildRecipe = DEFAULT_RECIPE) -> EmbeddedAssets:
    """Both models into `out_dir` (no locking, no atomic rename: see `ensure_embedded_assets`): the shipped build
    for the default recipe, trained here for any other."""
    out_dir = Path(out_dir)
    assets = EmbeddedAssets(policy_dir=out_dir / "policy", classifier_dir=out_dir / "classifier")
    if recipe == DEFAULT_RECIPE and shipped.copy_shipped(ASSETS_FOLDER, out_dir):
        return assets
    return train_embedded_assets(out_dir, recipe)


def train_embedded_assets(out_dir: Path, recipe: BuildRecipe = DEFAULT_RECIPE) -> EmbeddedAssets:
    """Train both models into `out_dir` (what the shipped build was made with)."""
    out_dir = Path(out_dir)
    assets = EmbeddedAssets(policy_dir=out_dir / "policy", classifier_dir=out_dir / "classifier")
    with isolated_build():
        facts = build_policy(assets.policy_dir, recipe)
        facts |= build_classifier(assets.classifier_dir, recipe)
    manifest = {"assets_version": ASSETS_VERSION, "recipe": dataclasses.asdict(recipe), **facts}
    # Written last: a folder with a manifest is a complete build.
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return assets


def embedded_cache_dir() -> Path:
    """`$REDTEAM_GRPO_CACHE` if set, else `~/.cache/redteam-grpo`."""
    env = os.environ.get("REDTEAM_GRPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "redteam-grpo"


def cache_dirname(prefix: str, recipe: Any, default: Any) -> str:
    """`<prefix>` for the default recipe, `<prefix>-<hash of the recipe>` for any other."""
    if recipe == default:
        return prefix
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode()).hexdigest()
    return f"{prefix}-{digest[:12]}"


def build_in_cache(final: Path, build: Callable[[Path], object], what: str) -> None:
    """`build(tmp)` into a temporary folder renamed to `final`, under a file lock; nothing if `final` is built.

    `build` writes ``manifest.json`` last, so a folder with a manifest is a complete build.
    """
    if (final / "manifest.json").is_file():
        return
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{final.name}.lock")):
        if (final / "manifest.json").is_file():  # another process built it while we waited
            return
        for stale in [*root.glob(f".{final.name}.tmp-*"), final]:  # left by a killed build
            if stale.exists():
                shutil.rmtree(stale)
        tmp = root / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        log.info("building %s into %s (first use)", what, final)
        try:
            build(tmp)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def ensure_embedded_assets(cache_dir: Path | None = None, *, recipe: BuildRecipe = DEFAULT_RECIPE) -> EmbeddedAssets:
    """The embedded models, put into the cache on first use (the shipped build; a non-default recipe is trained,
    ~30 s on 2 CPU cores), at once afterwards."""
    root = Path(cache_dir) if cache_dir is not None else embedded_cache_dir()
    final = root / cache_dirname(ASSETS_FOLDER, recipe, DEFAULT_RECIPE)
    # A lambda, so that the module-level `build_embedded_assets` is looked up at build time (tests replace it).
    build_in_cache(final, lambda tmp: build_embedded_assets(tmp, recipe), "the embedded policy and classifier")
    return EmbeddedAssets(policy_dir=final / "policy", classifier_dir=final / "classifier")


def ensure_embedded_guard(cache_dir: Path | None = None, *, recipe: GuardRecipe = DEFAULT_GUARD_RECIPE) -> Path:
    """The folder of the embedded guard, put into its own cache folder on first use (the shipped build; a
    non-default recipe is trained, ~30 s on 2 CPU cores).

    Separate from `ensure_embedded_assets`, so that a run with the classifier never pays for the guard and the
    policy/classifier folder (and `ASSETS_VERSION`) is unaffected by the guard's recipe.
    """
    root = Path(cache_dir) if cache_dir is not None else embedded_cache_dir()
    final = root / cache_dirname(GUARD_FOLDER, recipe, DEFAULT_GUARD_RECIPE)
    # A lambda, so that the module-level `build_embedded_guard` is looked up at build time (tests replace it).
    build_in_cache(final, lambda tmp: build_embedded_guard(tmp, recipe), "the embedded guard")
    return final / "guard"


def build_embedded_guard(out_dir: Path, recipe: GuardRecipe = DEFAULT_GUARD_RECIPE) -> Path:
    """The guard into `out_dir / "guard"` (no locking: see `ensure_embedded_guard`): the shipped build for the
    default recipe, trained here for any other."""
    if recipe == DEFAULT_GUARD_RECIPE and shipped.copy_shipped(GUARD_FOLDER, Path(out_dir)):
        return Path(out_dir) / "guard"
    return train_embedded_guard(out_dir, recipe)


def build_embedded_safe_policy(out_dir: Path, recipe: SafeRecipe = DEFAULT_SAFE_RECIPE) -> Path:
    """The defense base into `out_dir / "policy"` (no locking: see `ensure_embedded_safe_policy`): the shipped
    build for the default recipe, trained here for any other."""
    if recipe == DEFAULT_SAFE_RECIPE and shipped.copy_shipped(SAFE_FOLDER, Path(out_dir)):
        return Path(out_dir) / "policy"
    return train_embedded_safe_policy(out_dir, recipe)


def train_embedded_safe_policy(out_dir: Path, recipe: SafeRecipe = DEFAULT_SAFE_RECIPE) -> Path:
    """Train the defense base into `out_dir / "policy"` (what the shipped build was made with)."""
    out_dir = Path(out_dir)
    with isolated_build():
        facts = build_safe_policy(out_dir / "policy", recipe)
    manifest = {"safe_version": SAFE_VERSION, "recipe": dataclasses.asdict(recipe), **facts}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")  # last
    return out_dir / "policy"


def ensure_embedded_safe_policy(cache_dir: Path | None = None, *, recipe: SafeRecipe = DEFAULT_SAFE_RECIPE) -> Path:
    """The folder of ``embedded:tiny-qwen3-safe``, put into its own cache folder on first use (the shipped build; a
    non-default recipe is trained, ~1 min)."""
    root = Path(cache_dir) if cache_dir is not None else embedded_cache_dir()
    final = root / cache_dirname(SAFE_FOLDER, recipe, DEFAULT_SAFE_RECIPE)
    build_in_cache(final, lambda tmp: build_embedded_safe_policy(tmp, recipe), "the embedded defense base")
    return final / "policy"


def is_embedded(name: str) -> bool:
    return name.startswith("embedded:")


def resolve_model_path(name: str, cache_dir: Path | None = None) -> str:
    """An embedded name -> the folder of its built model (building it if needed); any other name unchanged."""
    if not is_embedded(name):
        return name
    if name not in _EMBEDDED_NAMES:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(_EMBEDDED_NAMES)}")
    if name == EMBEDDED_GUARD:  # built on its own: resolving the policy or classifier never builds the guard
        return str(ensure_embedded_guard(cache_dir))
    if name == EMBEDDED_SAFE_POLICY:
        return str(ensure_embedded_safe_policy(cache_dir))
    assets = ensure_embedded_assets(cache_dir)
    return str(assets.policy_dir if name == EMBEDDED_POLICY else assets.classifier_dir)


def default_trainers() -> dict[str, tuple[Callable[[Path, Any], object], Any]]:
    """Each shipped build's folder -> (the function that trains it, its default recipe)."""
    return {
        ASSETS_FOLDER: (train_embedded_assets, DEFAULT_RECIPE),
        GUARD_FOLDER: (train_embedded_guard, DEFAULT_GUARD_RECIPE),
        SAFE_FOLDER: (train_embedded_safe_policy, DEFAULT_SAFE_RECIPE),
    }
