"""The shipped default builds (embedded/shipped.py): what the current code builds, checked before use, the same
weights whatever the CPU, and a damaged file refused before anything reaches the cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from redteam_grpo.embedded import cache, recipes, shipped
from redteam_grpo.embedded.shipped import ShippedWeightsError

BUILDS = {
    cache.ASSETS_FOLDER: ("assets_version", recipes.ASSETS_VERSION, recipes.DEFAULT_RECIPE),
    cache.GUARD_FOLDER: ("guard_version", recipes.GUARD_VERSION, recipes.DEFAULT_GUARD_RECIPE),
    cache.SAFE_FOLDER: ("safe_version", recipes.SAFE_VERSION, recipes.DEFAULT_SAFE_RECIPE),
}
ROOT = Path(__file__).resolve().parents[2]


def _sums() -> dict[str, str]:
    lines = shipped.CHECKSUMS.read_text().splitlines()
    return {relative: digest for digest, _, relative in (line.partition("  ") for line in lines)}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_default_build_is_shipped_from_the_current_recipe_and_sources(name: str) -> None:
    key, version, recipe = BUILDS[name]
    folder = shipped.shipped_folder(name)
    assert folder is not None, f"no shipped build {name}: run `{shipped.REGENERATE}` and commit embedded/shipped"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest[key] == version and manifest["recipe"] == dataclasses.asdict(recipe)
    assert manifest["source_digest"] == shipped.source_digest(), (
        f"the build's sources changed since {name} was trained: run `{shipped.REGENERATE}` and commit embedded/shipped"
    )
    assert shipped.verify(name)  # every file listed, present and matching


def test_nothing_is_shipped_but_the_current_builds() -> None:
    folders = sorted(p.name for p in shipped.SHIPPED_DIR.iterdir() if p.is_dir())
    assert folders == sorted(BUILDS)
    assert {relative.split("/")[0] for relative in _sums()} == set(BUILDS)


def test_a_first_use_copies_the_shipped_build_without_training(tmp_path: Path, monkeypatch) -> None:
    def no_training(*_args, **_kwargs):
        raise AssertionError("a default recipe was trained instead of copied")

    for trainer in ("train_embedded_assets", "train_embedded_guard", "train_embedded_safe_policy"):
        monkeypatch.setattr(cache, trainer, no_training)
    cache.ensure_embedded_assets(tmp_path)
    cache.ensure_embedded_guard(tmp_path)
    cache.ensure_embedded_safe_policy(tmp_path)
    for relative, digest in _sums().items():
        assert hashlib.sha256((tmp_path / relative).read_bytes()).hexdigest() == digest, relative
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == sorted(BUILDS)


def test_the_weights_in_use_are_the_same_under_every_cpu_kernel_set(tmp_path: Path) -> None:
    """A process whose kernels are AVX2 (or none) resolves the embedded names to files with the shipped
    checksums: the weights do not depend on the CPU that runs them (they were trained once)."""
    probe = (
        "from redteam_grpo.embedded import resolve_model_path as r; "
        "[r(n) for n in ('embedded:tiny-qwen3', 'embedded:tiny-guard', 'embedded:tiny-qwen3-safe')]"
    )
    for capability in ("avx2", "default"):
        folder = tmp_path / capability
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "REDTEAM_GRPO_CACHE": str(folder)}
        subprocess.run([sys.executable, "-c", probe], env=env, check=True, cwd=ROOT, timeout=300)
        for relative, digest in _sums().items():
            assert hashlib.sha256((folder / relative).read_bytes()).hexdigest() == digest, (capability, relative)


@pytest.fixture
def shipped_copy(tmp_path: Path, monkeypatch) -> Path:
    """The shipped folder copied aside and used in its place, to be damaged."""
    copy = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_DIR, copy)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", copy)
    monkeypatch.setattr(shipped, "CHECKSUMS", copy / "SHA256SUMS")
    return copy


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    ["flipped-byte", "missing-file", "unlisted-file"],
)
def test_a_damaged_shipped_build_is_refused_naming_the_file_and_nothing_reaches_the_cache(
    shipped_copy: Path, tmp_path: Path, damage: str
) -> None:
    name = cache.ASSETS_FOLDER
    weights = shipped_copy / name / "policy" / "model.safetensors"
    if damage == "flipped-byte":
        _damage(weights)
        expected = "does not match its SHA-256"
    elif damage == "missing-file":
        weights.unlink()
        expected = "is missing"
    else:
        (shipped_copy / name / "policy" / "extra.py").write_text("print('not ours')\n")
        weights = shipped_copy / name / "policy" / "extra.py"
        expected = "is not listed"
    cache_dir = tmp_path / "cache"
    with pytest.raises(ShippedWeightsError, match=expected) as err:
        cache.ensure_embedded_assets(cache_dir)
    assert str(weights) in str(err.value) and "reinstall redteam-grpo" in str(err.value)
    assert [p.name for p in cache_dir.iterdir() if not p.name.endswith(".lock")] == []


def test_the_defense_base_s_recipe_trains_here_into_the_shipped_tokenizer_and_architecture(tmp_path: Path) -> None:
    """The safe base's training path, which no other test takes now that its default build is shipped: a 2-step
    build of its recipe writes the shipped tokenizer, chat template and configuration, byte for byte."""
    from safetensors.torch import load_file

    short = dataclasses.replace(recipes.DEFAULT_SAFE_RECIPE, policy_steps=2)
    trained = cache.train_embedded_safe_policy(tmp_path / "safe", short)
    shipped_dir = shipped.shipped_folder(cache.SAFE_FOLDER) / "policy"
    names = sorted(p.name for p in shipped_dir.iterdir())
    assert names == sorted(p.name for p in trained.iterdir())
    for name in names:
        if name != "model.safetensors":
            assert (shipped_dir / name).read_bytes() == (trained / name).read_bytes(), name
    here, there = load_file(trained / "model.safetensors"), load_file(shipped_dir / "model.safetensors")
    assert {k: v.shape for k, v in here.items()} == {k: v.shape for k, v in there.items()}
