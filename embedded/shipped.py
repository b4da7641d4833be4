"""The embedded models' default builds, shipped with the package so that every machine runs the same weights.

Training the same recipe on two CPUs gives two models: the build is deterministic on one machine, but its matrix
kernels (AVX2 on one, AVX-512 on another) sum in other orders, and a few hundred optimiser steps turn the last-bit
differences into other weights, so every figure measured on the embedded world (learning curves, defense
results, test thresholds) would hold on one kind of CPU only. The default recipes' builds are therefore trained
once, by `python -m redteam_grpo.embedded --weights`, and shipped in `embedded/shipped/<cache folder>/`, with a
SHA-256 of every file in `embedded/shipped/SHA256SUMS` (`sha256sum -c` reads it). A first use copies the shipped
folder into the cache after checking every checksum; a non-default recipe is still trained on the machine.

Each shipped manifest records the recipe, its version and a digest of the build's sources (the `embedded`
package and the bundled resources): a change to either without new weights is refused by the tests
(`tests/embedded/test_shipped_weights.py`), so the shipped weights are always what the current code builds.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
CHECKSUMS = SHIPPED_DIR / "SHA256SUMS"
REGENERATE = "python -m redteam_grpo.embedded --weights"


class ShippedWeightsError(RuntimeError):
    """A shipped file is missing or does not match its checksum."""


# The modules whose code decides what a build trains (the cache's locking and this file's copying do not).
BUILD_MODULES = (
    "bpe.py",
    "classifier.py",
    "corpus.py",
    "defense.py",
    "guard.py",
    "policy.py",
    "recipes.py",
    "safe_policy.py",
    "training.py",
)


# Bundled resources that no build reads: a change to them asks for no new weights.
NOT_BUILD_SOURCES = ("refusals.jsonl",)  # Active Attacks' hardening targets (core/config.py: ActiveConfig.refusals)


def source_digest() -> str:
    """SHA-256 over what the builds are made of: the build modules and the bundled resources they read."""
    package = Path(__file__).resolve().parent
    resources = package.parent / "core" / "resources"
    digest = hashlib.sha256()
    read = [path for path in sorted(resources.glob("*.json*")) if path.name not in NOT_BUILD_SOURCES]
    for path in [*(package / name for name in BUILD_MODULES), *read]:
        digest.update(f"{path.parent.name}/{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_facts() -> dict[str, str]:
    """Where the shipped weights were trained (recorded in their manifests; they are the same on every machine)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
    ]
    cpu = names[0] if cpuinfo.is_file() and names else platform.processor() or platform.machine()
    kernels = torch.backends.cpu.get_cpu_capability()
    return {"trained_on": f"{cpu} ({kernels} kernels)", "torch": torch.__version__.split("+")[0]}


def _checksums() -> dict[str, str]:
    """relative path -> SHA-256, as `sha256sum` writes them."""
    if not CHECKSUMS.is_file():
        return {}
    sums = {}
    for line in CHECKSUMS.read_text(encoding="utf-8").splitlines():
        digest, _, relative = line.partition("  ")
        sums[relative] = digest
    return sums


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shipped_folder(name: str) -> Path | None:
    """The shipped build of the cache folder `name` (`embedded-v3`, ...), or None if none is shipped."""
    folder = SHIPPED_DIR / name
    return folder if (folder / "manifest.json").is_file() else None


def verify(name: str) -> list[Path]:
    """The files of the shipped build `name`, each checked against SHA256SUMS; raises naming the first that is
    missing, unlisted or different."""
    folder = SHIPPED_DIR / name
    listed = {relative: digest for relative, digest in _checksums().items() if relative.startswith(f"{name}/")}
    present = sorted(p for p in folder.rglob("*") if p.is_file())
    way_out = (
        "the package's embedded weights are damaged: reinstall redteam-grpo (or, in a checkout, "
        f"`git checkout -- embedded/shipped`; `{REGENERATE}` trains new ones)"
    )
    if not listed:
        raise ShippedWeightsError(f"{CHECKSUMS} lists no file of {name}: {way_out}")
    for path in present:
        relative = path.relative_to(SHIPPED_DIR).as_posix()
        if relative not in listed:
            raise ShippedWeightsError(f"{path} is not listed in {CHECKSUMS}: {way_out}")
    for relative, digest in listed.items():
        path = SHIPPED_DIR / relative
        if not path.is_file():
            raise ShippedWeightsError(f"{path} is missing: {way_out}")
        if _sha256(path) != digest:
            raise ShippedWeightsError(f"{path} does not match its SHA-256 in {CHECKSUMS}: {way_out}")
    return present


def copy_shipped(name: str, out_dir: Path) -> bool:
    """Copy the shipped build `name` into `out_dir` (manifest last, as a build writes it) after checking every
    checksum; False if no build of that name is shipped."""
    if shipped_folder(name) is None:
        return False
    files = verify(name)
    folder = SHIPPED_DIR / name
    for path in sorted(files, key=lambda p: p.name == "manifest.json" and p.parent == folder):
        target = Path(out_dir) / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return True


def write_checksums() -> Path:
    """SHA256SUMS for every file under `embedded/shipped/` (the regeneration command writes it last)."""
    lines = [
        f"{_sha256(path)}  {path.relative_to(SHIPPED_DIR).as_posix()}"
        for path in sorted(SHIPPED_DIR.rglob("*"))
        if path.is_file() and path != CHECKSUMS
    ]
    CHECKSUMS.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return CHECKSUMS
