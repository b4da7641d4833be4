"""The process environment every test process starts with: set before any library is imported, because several read
it at import (huggingface_hub's offline switch, torch's thread count). tests/conftest.py applies it, and so does
tests/bug_classes.py before its fork server imports those libraries once for every class it checks."""

from __future__ import annotations

import os

FIXED = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# One compute thread per process: the suite runs in parallel (pytest -n auto, one worker per core) and starts
# runs, servers and Ray workers as subprocesses; with a thread per core each, the tiny models' kernels spin
# against each other (measured: up to 30x slower on a shared 2-core machine). Inherited by every subprocess.
DEFAULTS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}


def apply() -> None:
    os.environ.update(FIXED)
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
