"""Which scoring backend a stage talks to: the scorers in this process, or the reward server's client."""

from __future__ import annotations

import torch

from redteam_grpo.core.config import RewardConfig, Secrets
from redteam_grpo.core.scoring.backend import ScoringBackend, build_local_scoring
from redteam_grpo.tasks.logs import stage_logger


def scoring_backend(cfg: RewardConfig, device: torch.device) -> ScoringBackend:
    """In-process scorers, or the reward server's client (several: replicas) when reward.url is set (checked to serve
    the same)."""
    if not cfg.urls:
        return build_local_scoring(cfg, device)
    from redteam_grpo.server.client import ReplicatedRewardClient, RewardClient

    token = Secrets().reward_token
    secret = token.get_secret_value() if token else None
    clients = [RewardClient.from_config(cfg, url, secret, stage_logger) for url in cfg.urls]
    client = clients[0] if len(clients) == 1 else ReplicatedRewardClient(clients, stage_logger)
    client.verify(cfg)
    return client
