"""docker-compose.yml is a valid Compose file (`docker compose config` / `docker-compose config`: no engine needed),
wires the services together as documented, and refuses to start without its secrets."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from redteam_grpo.core.config import load_config
from redteam_grpo.server.vllm_client import ENGINE_GUARD, ENGINE_GUARD_DIR, serve_command
from redteam_grpo.server.vllm_env import VLLM_RELEASE, Engine

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {
    "POSTGRES_PASSWORD": "db-secret",
    "REDTEAM_GRPO_REWARD_TOKEN": "reward-secret-of-32-characters",
    "PREFECT_API_AUTH_STRING": "admin:prefect-secret",
}
GPU_SECRETS = {**SECRETS, "REDTEAM_GRPO_SAMPLER_TOKEN": "sampler-secret-of-32-characters"}


def _compose() -> list[str]:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if os.environ.get("REDTEAM_GRPO_REQUIRE_COMPOSE") == "1":  # CI installs it: never skip there
        pytest.fail("neither `docker compose` nor `docker-compose` is installed")
    pytest.skip("neither `docker compose` nor `docker-compose` is installed")


def _config(*files: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    args = [*_compose(), *(a for f in files for a in ("-f", f)), "config"]
    clean = {k: v for k, v in os.environ.items() if k not in GPU_SECRETS and k != "VLLM_IMAGE"}
    return subprocess.run(args, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)


def _port(entry) -> str:
    """A published port as host_ip:published:target (compose v1 prints strings, v2 mappings)."""
    if isinstance(entry, str):
        return entry.removesuffix("/tcp")
    return f"{entry['host_ip']}:{entry['published']}:{entry['target']}"


def test_compose_file_is_valid_and_wires_the_services():
    result = _config("docker-compose.yml", env=SECRETS)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"postgres", "prefect-server", "worker", "reward-server"}
    server = services["prefect-server"]
    assert server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://prefect:db-secret@postgres:5432/"
    )
    assert [_port(p) for p in server["ports"]] == ["127.0.0.1:4200:4200"]
    # the API asks who is calling, and the worker (the one client inside) says it
    assert server["environment"]["PREFECT_SERVER_API_AUTH_STRING"] == SECRETS["PREFECT_API_AUTH_STRING"]
    worker = services["worker"]
    assert worker["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["environment"]["PREFECT_API_AUTH_STRING"] == SECRETS["PREFECT_API_AUTH_STRING"]
    assert "prefect --no-prompt deploy --all" in " ".join(worker["command"])
    # the GPU slots runs take with runtime.gpu_slot=gpu: created once, one per GPU
    assert "prefect gcl create gpu --limit 1" in " ".join(worker["command"])
    # the automation that marks a run whose process died Crashed, created once
    assert "prefect automation create --from-file deploy/unresponsive-runs.yaml" in " ".join(worker["command"])
    assert {str(v).split(":")[1] if isinstance(v, str) else v["target"] for v in worker["volumes"]} == {
        "/app/runs",
        "/cache",
    }
    assert "deploy" not in worker  # no GPU unless asked for
    reward = services["reward-server"]
    assert "ports" not in reward  # reachable from the worker only
    assert reward["environment"]["REDTEAM_GRPO_REWARD_TOKEN"] == SECRETS["REDTEAM_GRPO_REWARD_TOKEN"]
    assert "0.0.0.0" in reward["command"] and "50050" in reward["command"]


def test_the_gpu_override_adds_a_vllm_sampler_and_reserves_gpus_for_it_and_the_worker():
    result = _config("docker-compose.yml", "docker-compose.gpu.yml", env=GPU_SECRETS)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("worker", "sampler"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert all("deploy" not in s for name, s in services.items() if name not in ("worker", "sampler"))
    sampler = services["sampler"]
    # the adapters a run exports are read at the path the worker wrote them
    runs = [v for v in sampler["volumes"] if (v["target"] if isinstance(v, dict) else v.split(":")[1]) == "/app/runs"]
    assert runs and sampler["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # it loads any adapter folder it can read on request: it requires a key, which the worker's client sends
    key = GPU_SECRETS["REDTEAM_GRPO_SAMPLER_TOKEN"]
    assert sampler["environment"]["VLLM_API_KEY"] == key and key not in sampler["command"]
    assert services["worker"]["environment"]["REDTEAM_GRPO_SAMPLER_TOKEN"] == key
    # the guard that requires it on every path is mounted where PYTHONPATH finds it
    guard = sampler["environment"]["PYTHONPATH"]
    mounts = {str(v["target"]): str(v["source"]) for v in sampler["volumes"] if isinstance(v, dict)}
    mounts |= {v.split(":")[1]: v.split(":")[0] for v in sampler["volumes"] if isinstance(v, str)}
    assert Path(mounts[guard]).resolve() == ENGINE_GUARD_DIR
    # the engine install-sampler installs, not whatever `latest` is today
    assert sampler["image"] == f"vllm/vllm-openai:v{VLLM_RELEASE}"
    # the same flags as `redteam-grpo serve-sampler` for the shipped real-model config
    cfg = load_config(ROOT / "configs" / "qwen3-4b-instruct.yaml", [])
    m = cfg.model
    command, _ = serve_command(
        Engine.executable("vllm"),
        m.policy,
        None,
        m.dtype,
        m.lora_rank,
        m.max_prompt_tokens + cfg.sampling.max_new_tokens,
        "0.0.0.0",
        8100,
        0,
        [],
    )
    assert [*sampler["entrypoint"], *sampler["command"]] == command and ENGINE_GUARD in command


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_a_missing_secret_is_named(missing):
    result = _config("docker-compose.yml", env={k: v for k, v in SECRETS.items() if k != missing})
    assert result.returncode != 0 and f"set {missing}" in result.stderr + result.stdout


def test_the_gpu_override_refuses_to_start_the_sampler_without_its_key():
    result = _config("docker-compose.yml", "docker-compose.gpu.yml", env=SECRETS)
    assert result.returncode != 0 and "set REDTEAM_GRPO_SAMPLER_TOKEN" in result.stderr + result.stdout
