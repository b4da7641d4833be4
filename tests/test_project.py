"""The README's promises that a fresh machine depends on."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    readme_lines = (ROOT / "README.md").read_text().splitlines()
    block = readme_lines[readme_lines.index("```bash") + 1 : readme_lines.index("```bash") + 3]
    assert len(block) == 2 and block[0].endswith("redteam-grpo run") and block[1].endswith("pytest")
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert block[1] in ci_lines


def test_the_network_guard_refuses_and_records_non_loopback_connections():
    import socket

    import pytest

    from tests import netguard

    before = len(netguard.attempted_connections)
    with pytest.raises(netguard.NetworkAccessError):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    with pytest.raises(netguard.NetworkAccessError):
        socket.socket().connect(("8.8.8.8", 53))
    assert len(netguard.attempted_connections) == before + 2
    del netguard.attempted_connections[before:]  # the e2e tests assert this list stays empty
