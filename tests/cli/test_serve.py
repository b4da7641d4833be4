"""`serve-reward` and `serve-sampler`: what they refuse before binding a port, and what they start the server with."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from redteam_grpo.cli.main import app

runner = CliRunner()
KEY = "sampler-key-of-32-characters-xyz"


@pytest.fixture(autouse=True)
def no_tokens(monkeypatch, tmp_path):
    """No token from the environment, nor from a .env file in the working directory."""
    monkeypatch.chdir(tmp_path)
    for variable in ("REDTEAM_GRPO_SAMPLER_TOKEN", "REDTEAM_GRPO_REWARD_TOKEN", "VLLM_API_KEY"):
        monkeypatch.delenv(variable, raising=False)


def _said(result) -> str:
    return " ".join(result.output.split())  # the console wraps long lines


def _sampler(*args: str):
    return runner.invoke(app, ["serve-sampler", "--vllm", "vllm", "--print", *args])


@pytest.mark.parametrize(
    ("token", "why"), [(None, "set REDTEAM_GRPO_SAMPLER_TOKEN"), ("", "set"), ("k" * 15, "only 15")]
)
def test_serve_sampler_beyond_loopback_needs_an_api_key_of_16_characters(monkeypatch, token, why):
    if token is not None:
        monkeypatch.setenv("REDTEAM_GRPO_SAMPLER_TOKEN", token)
    result = _sampler("--host", "0.0.0.0")
    assert result.exit_code == 2, result.output
    said = _said(result)
    assert "REDTEAM_GRPO_SAMPLER_TOKEN" in said and why in said and "at least 16" in said and "127.0.0.1" in said


def test_serve_sampler_hands_its_key_to_the_engine_and_never_prints_it(monkeypatch):
    monkeypatch.setenv("REDTEAM_GRPO_SAMPLER_TOKEN", KEY)
    result = _sampler("--host", "0.0.0.0")
    assert result.exit_code == 0, result.output
    assert KEY not in result.output
    assert "VLLM_API_KEY=$REDTEAM_GRPO_SAMPLER_TOKEN" in result.output
    assert "--middleware redteam_grpo_api_key_guard.RequireApiKey" in result.output
    monkeypatch.delenv("REDTEAM_GRPO_SAMPLER_TOKEN")
    on_loopback = _sampler()  # no key needed there, and none set
    assert on_loopback.exit_code == 0 and "VLLM_API_KEY" not in on_loopback.output


@pytest.mark.parametrize("token", [None, "", "r" * 15])
def test_serve_reward_beyond_loopback_needs_a_token_of_16_characters(monkeypatch, token):
    import uvicorn

    started = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: started.append(options))  # never serve the network
    if token is not None:
        monkeypatch.setenv("REDTEAM_GRPO_REWARD_TOKEN", token)
    result = runner.invoke(app, ["serve-reward", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and not started, result.output
    assert "REDTEAM_GRPO_REWARD_TOKEN" in _said(result) and "at least 16" in _said(result)


@pytest.mark.parametrize(
    ("given", "missing"), [("--ssl-certfile", "--ssl-keyfile"), ("--ssl-keyfile", "--ssl-certfile")]
)
def test_serve_reward_takes_a_certificate_only_with_its_key(tmp_path, given, missing):
    (tmp_path / "file.pem").write_text("")
    result = runner.invoke(app, ["serve-reward", given, str(tmp_path / "file.pem")])
    assert result.exit_code == 2 and f"{given} needs {missing} too" in _said(result), result.output


def test_serve_reward_serves_https_with_the_certificate_it_is_given(monkeypatch, tmp_path, embedded_assets):
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: started.update(options))
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    missing = runner.invoke(app, ["serve-reward", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert missing.exit_code == 2 and "no such file" in _said(missing) and not started
    cert.write_text("certificate")
    key.write_text("key")
    result = runner.invoke(app, ["serve-reward", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert result.exit_code == 0, result.output
    assert started["ssl_certfile"] == str(cert) and started["ssl_keyfile"] == str(key)
    assert started["host"] == "127.0.0.1"
