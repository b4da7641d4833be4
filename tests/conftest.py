"""Test-wide settings: no network outside loopback, a private Prefect home, one tiny asset cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="redteam-grpo-tests-"))
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ["DO_NOT_TRACK"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)
# The embedded assets are built once per machine (deterministic); tests share the user cache unless told.
os.environ.setdefault("REDTEAM_GRPO_CACHE", str(Path.home() / ".cache" / "redteam-grpo"))


from tests import netguard  # noqa: E402  (after the environment above is set)

netguard.install()
attempted_connections = netguard.attempted_connections


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
