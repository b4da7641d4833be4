"""Reward-server settings: what to load (a `RewardConfig`), where to listen, batching and request limits."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from redteam_grpo.core.config import RewardConfig

DEFAULT_PORT = 50050  # the reference system's reward server port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: RewardConfig = RewardConfig()
    """What to load: reward.scorer, scorer_type, toxic_label, refusal classifier, embedder, batch size."""
    serve_embedder: bool = False
    """Load reward.embedder and serve POST /embed (needed by runs with reward.novelty_weight > 0)."""
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    device: str = "auto"
    max_batch: int = Field(64, gt=0)
    """Texts per model call that concurrent requests are batched up to."""
    max_wait_ms: float = Field(5.0, ge=0.0)
    """How long a request waits for others to share its model call."""
    max_texts: int = Field(512, gt=0)
    """Texts per request (more: 413)."""
    max_chars: int = Field(20_000, gt=0)
    """Characters per text (more: 422)."""
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    """Request body size (more: 413)."""
    token: SecretStr | None = None
    """Bearer token required on /score and /embed (from REDTEAM_GRPO_REWARD_TOKEN). Required off loopback."""

    def check_exposure(self) -> None:
        """Binding beyond loopback without a token would hand the scorer to the network."""
        if not is_loopback(self.host) and self.token is None:
            raise ValueError(
                f"--host {self.host} accepts connections from other machines: set REDTEAM_GRPO_REWARD_TOKEN "
                "to a secret the clients share, or bind to 127.0.0.1"
            )
