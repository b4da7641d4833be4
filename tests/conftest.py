"""Test-wide settings: no network outside loopback, a private Prefect home, one tiny asset cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests import environment  # plain settings: imports nothing else

environment.apply()
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="redteam-grpo-tests-"))
# Each test process a Prefect home of its own, and so a database: pytest-xdist's workers inherit the environment of
# the process that starts them, which has loaded this file too, and the runs of two workers' CLI tests would start
# their temporary API servers on one SQLite file (a write then can fail with "database is locked").
os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect")
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)
# The embedded assets are built once per machine (deterministic); tests share the user cache unless told.
os.environ.setdefault("REDTEAM_GRPO_CACHE", str(Path.home() / ".cache" / "redteam-grpo"))


from tests import netguard  # noqa: E402  (after the environment above is set)

netguard.install()
attempted_connections = netguard.attempted_connections


# The files that take longest, longest first (seconds of one worker, measured with `pytest -n 2 --durations=0` on
# 2 cores: 770, 750, 540, 425, 300, 230, 115, 90, 80, 80). Under `pytest -n` every worker orders its files this way and
# hands the next one to whichever worker is free, so the long ones start first and the many short ones fill in
# behind them; the same files last left one worker idle for 9 minutes.
LONGEST_FILES = (
    "tests/flows/test_defense.py",
    "tests/e2e/test_cli.py",
    "tests/flows/test_learning.py",
    "tests/core/test_first_update_check.py",
    "tests/e2e/test_vllm_engine.py",
    "tests/e2e/test_prefect_deployment.py",
    "tests/embedded/test_embedded_judge.py",
    "tests/embedded/test_embedded.py",
    "tests/flows/test_scale_out.py",
    "tests/core/test_judge_formats.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker collects; all must order alike (a stable sort)
        rank = {path: i for i, path in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    return _SESSION_TMP


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect API for the whole session (it takes seconds to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def embedded_assets():
    from redteam_grpo.embedded import ensure_embedded_assets

    return ensure_embedded_assets()


@pytest.fixture
def tiny_policy(embedded_assets):
    """A fresh policy (embedded tiny Qwen3 + LoRA) on CPU; temperature 0.7 so tempering is exercised."""
    import torch

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import load_policy

    return load_policy(ModelConfig(), temperature=0.7, device=torch.device("cpu"), seed=0)


@pytest.fixture
def memory_store():
    """A URL in fsspec's in-memory file system: object-storage semantics (no rename, no lock) in this process;
    emptied afterwards."""
    import uuid

    import fsspec

    bucket = f"bucket-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)
