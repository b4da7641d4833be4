"""Test-wide settings: no network outside loopback, a private Prefect home, one tiny asset cache."""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="redteam-grpo-tests-"))
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
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


class NetworkAccessError(RuntimeError):
    pass


def _is_loopback(address) -> bool:
    if not isinstance(address, tuple):
        return isinstance(address, str | bytes)  # an AF_UNIX path is local
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo
attempted_connections: list[object] = []


def _guarded_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
        attempted_connections.append(address)
        raise NetworkAccessError(f"test tried to connect to {address}: only loopback is allowed")
    return _real_connect(self, address)


def _guarded_connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
        attempted_connections.append(address)
        raise NetworkAccessError(f"test tried to connect to {address}: only loopback is allowed")
    return _real_connect_ex(self, address)


def _guarded_getaddrinfo(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and not _is_loopback((name,)) and name not in ("127.0.0.1", "::1"):
        try:
            ipaddress.ip_address(name)
        except ValueError:
            attempted_connections.append(name)
            raise NetworkAccessError(f"test tried to resolve {name}: only loopback is allowed") from None
    return _real_getaddrinfo(host, *args, **kwargs)


socket.socket.connect = _guarded_connect
socket.socket.connect_ex = _guarded_connect_ex
socket.getaddrinfo = _guarded_getaddrinfo


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
    from redteam_grpo.core.embedded import ensure_embedded_assets

    return ensure_embedded_assets()


@pytest.fixture
def tiny_policy(embedded_assets):
    """A fresh policy (embedded tiny Qwen3 + LoRA) on CPU; temperature 0.7 so tempering is exercised."""
    import torch

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.policy import load_policy

    return load_policy(ModelConfig(), temperature=0.7, device=torch.device("cpu"), seed=0)
