"""Reward-server settings: what to load (a `RewardConfig`), where to listen, batching and request limits; and the rule
both servers (the reward server and the vLLM sampler) follow before they bind: beyond loopback, a bearer token."""

from __future__ import annotations

import logging
import threading

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from redteam_grpo.core.config import RewardConfig, Secrets
from redteam_grpo.core.hosts import is_loopback

DEFAULT_PORT = 50050  # the reference system's reward server port
REWARD_TOKEN_ENV = "REDTEAM_GRPO_REWARD_TOKEN"
SAMPLER_TOKEN_ENV = "REDTEAM_GRPO_SAMPLER_TOKEN"
MIN_TOKEN_CHARS = 16  # a token that other machines may guess at must not be guessable
NEW_TOKEN_COMMAND = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def no_empty_token(token: str | SecretStr | None) -> str | None:
    """The token, or None for none: an empty (or blank) one is no token, never a token that matches no header."""
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    return value if value and value.strip() else None


def check_exposure(host: str, token: str | SecretStr | None, variable: str) -> None:
    """Binding beyond loopback without a long enough token would hand the server to the network."""
    if is_loopback(host):
        return
    value = no_empty_token(token)
    if value is None:
        raise ValueError(
            f"--host {host} accepts connections from other machines: set {variable} to a secret of at least "
            f"{MIN_TOKEN_CHARS} characters that the clients share (e.g. `{NEW_TOKEN_COMMAND}`), or bind to 127.0.0.1"
        )
    if len(value) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"--host {host} accepts connections from other machines, and {variable} has only {len(value)} "
            f"characters: set it to a secret of at least {MIN_TOKEN_CHARS} (e.g. `{NEW_TOKEN_COMMAND}`), or bind "
            "to 127.0.0.1"
        )


_warned_in_clear: set[str] = set()  # servers warned about: once per process, not once per stage's client
_warned_lock = threading.Lock()


def token_in_clear(url: str) -> bool:
    """A bearer token sent to `url` crosses the network unencrypted: plain http to a host that is not loopback."""
    parsed = httpx.URL(url)
    return parsed.scheme == "http" and not is_loopback(parsed.host)


def warn_token_in_clear(url: str, logger: logging.Logger | logging.LoggerAdapter, what: str, tls: str) -> None:
    """One warning line per server and process when a client sends its token to `url` in clear; `tls` says how to
    serve it over TLS instead."""
    if not token_in_clear(url):
        return
    with _warned_lock:
        if url in _warned_in_clear:
            return
        _warned_in_clear.add(url)
    logger.warning(
        "%s %s is reached over plain http: its bearer token crosses the network readable; serve it over TLS (%s) "
        "and use an https:// URL",
        what,
        url,
        tls,
    )


def sampler_token() -> str | None:
    """The vLLM sampler's API key (core.config.Secrets: the environment or ./.env; empty is none)."""
    return no_empty_token(Secrets().sampler_token)


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: RewardConfig = RewardConfig()
    """What to load: reward.scorer, scorer_type, toxic_label, refusal classifier, embedder, batch size."""
    serve_embedder: bool = False
    """Load reward.embedder and serve POST /embed (needed by runs with reward.novelty_weight > 0)."""
    host: str = "127.0.0.1"
    """The interface the server binds. On loopback it answers only requests addressed to a loopback name (the Host
    header), so that a web page whose name resolves to 127.0.0.1 (DNS rebinding) cannot reach it."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    device: str = "auto"
    max_batch: int = Field(64, gt=0)
    """Texts per model call that concurrent requests are batched up to."""
    max_wait_ms: float = Field(5.0, ge=0.0)
    """How long a request waits for others to share its model call."""
    max_queued_texts: int = Field(4096, gt=0)
    """Texts of requests waiting for (or in) a model call, per endpoint; a request that would go beyond gets 503 with
    Retry-After, which the client retries. A request alone in the queue is always taken."""
    max_texts: int = Field(512, gt=0)
    """Texts per request (more: 413)."""
    max_chars: int = Field(20_000, gt=0)
    """Characters per text (more: 422)."""
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    """Request body size (more: 413)."""
    token: SecretStr | None = None
    """Bearer token required on /score and /embed, and for the details of /ready (from REDTEAM_GRPO_REWARD_TOKEN).
    Required off loopback, of at least 16 characters; an empty one is none."""

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, token: str | SecretStr | None) -> str | SecretStr | None:
        return token if no_empty_token(token) is not None else None

    @property
    def on_loopback(self) -> bool:
        return is_loopback(self.host)

    def check_exposure(self) -> None:
        """Binding beyond loopback without a long enough token would hand the scorer to the network."""
        check_exposure(self.host, self.token, REWARD_TOKEN_ENV)
