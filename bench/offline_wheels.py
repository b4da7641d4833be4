"""The wheels a GPU machine without network needs to run the benchmarks: this project's runtime dependencies
(pyproject.toml), downloaded here for the machine's Python and platform, less the packages that machine already
has (a `pip list --format=freeze` of it, or one name per line) and less torch and the CUDA wheels it must keep
as they are. `bash bench/gpu_session.sh` installs them from WHEELS (default .whl) with --no-deps.

    python bench/offline_wheels.py OUT [--present LIST] [--leave-out duckdb] [--python-version 3.12]

`--leave-out duckdb` saves 24 of ~60 MB where the wheels must travel light: DuckDB serves `inspect` and `report`,
which no benchmark runs.

Prints what it kept and their size; exit status 1 when pip could not resolve the set for that platform.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# What a GPU machine brings for its own driver and CUDA: never replaced by a download made here.
KEPT_AS_THEY_ARE = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")


def wheel_name(path: Path) -> str:
    return canonicalize_name(parse_wheel_filename(path.name)[0])


def present_names(listing: str) -> set[str]:
    """Names from `pip list --format=freeze` lines (NAME==VERSION), `pip list` columns or one name per line."""
    names = set()
    for line in listing.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "Package", "---")):
            continue
        names.add(canonicalize_name(re.split(r"[=<>~!@ ]", line, maxsplit=1)[0]))
    return names


def requirements(present: set[str]) -> list[str]:
    """The project's runtime requirements the machine lacks. Those it has are not resolved at all: a package that
    needs torch (peft) would otherwise bring a torch wheel of gigabytes into the download, to be thrown away."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lacking = []
    for requirement in project["dependencies"]:
        name = canonicalize_name(Requirement(requirement).name)
        if name not in present and not KEPT_AS_THEY_ARE.match(name):
            lacking.append(requirement)
    return lacking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--present", type=Path, help="the machine's package list (pip list --format=freeze)")
    parser.add_argument("--leave-out", action="append", default=[], help="a requirement not to download")
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args()
    present = present_names(args.present.read_text()) if args.present else set()
    present |= {canonicalize_name(name) for name in args.leave_out}
    with tempfile.TemporaryDirectory() as scratch:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--implementation", "cp"]
        command += ["--python-version", args.python_version, *platforms, "--platform", "any", "-d", scratch]
        done = subprocess.run([*command, *requirements(present)], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr.strip()[-2000:], file=sys.stderr)
            raise SystemExit(1)
        args.out.mkdir(parents=True, exist_ok=True)
        kept = []
        for wheel in sorted(Path(scratch).glob("*.whl")):
            name = wheel_name(wheel)
            if name in present or KEPT_AS_THEY_ARE.match(name):
                continue
            shutil.copy2(wheel, args.out / wheel.name)
            kept.append(wheel)
    size = sum((args.out / w.name).stat().st_size for w in kept)
    print(f"{len(kept)} wheels, {size / 1e6:.1f} MB, in {args.out} (left out: {len(present)} names present there)")
    for wheel in kept:
        print(f"  {wheel.name}")


if __name__ == "__main__":
    main()
