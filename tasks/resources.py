"""What the stages of one run share inside a process: the loaded policy, optimizer, scorer and prompts.

Stages exchange files, not objects; this cache only saves reloading a model between stages. It tracks which
update the in-memory adapter came from (`version`), and a stage that needs another version loads it from the
run directory, so a resumed or re-run stage always computes on the weights it would have had.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from redteam_grpo.core.config import Config, RewardConfig
from redteam_grpo.core.data import Prompt, load_prompts
from redteam_grpo.core.policy import Policy, load_policy, resolve_device
from redteam_grpo.core.scoring import ScoringBackend, build_local_scoring
from redteam_grpo.core.train import make_optimizer
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.lineage import read_lineage
from redteam_grpo.storage.rundir import RunDir

INIT_VERSION = -1


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a label, the same in every process (resume reproduces it)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow or task run; a plain logger when a stage is called directly."""
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # MissingContextError outside a run
        return logging.getLogger("redteam_grpo")


def scoring_backend(cfg: RewardConfig, device: torch.device) -> ScoringBackend:
    """In-process scorers, or the reward server's client when reward.url is set (checked to serve the same)."""
    if not cfg.url:
        return build_local_scoring(cfg, device)
    from redteam_grpo.core.config import Secrets
    from redteam_grpo.server.client import RewardClient

    token = Secrets().reward_token
    client = RewardClient.from_config(cfg, token.get_secret_value() if token else None, stage_logger)
    client.verify(cfg)
    return client


@dataclass
class RunResources:
    run: RunDir
    config: Config
    device: torch.device
    policy: Policy
    optimizer: torch.optim.Optimizer
    version: int | None = None  # None: the fresh LoRA init, not yet tied to a checkpoint
    _scoring: ScoringBackend | None = field(default=None, repr=False)
    _prompts: list[Prompt] | None = field(default=None, repr=False)

    @property
    def scoring(self) -> ScoringBackend:
        """In-process scorers, or the reward server's client when reward.url is set (checked to serve the same)."""
        if self._scoring is None:
            self._scoring = scoring_backend(self.config.reward, self.device)
        return self._scoring

    @property
    def prompts(self) -> list[Prompt]:
        """The prompt source; in a lineage, less the prompts its earlier runs sampled (while enough remain)."""
        if self._prompts is None:
            prompts = load_prompts(self.config.data)
            record = read_lineage(self.run)
            if record is not None and record.excluded_prompt_ids:
                excluded = set(record.excluded_prompt_ids)
                fresh = [p for p in prompts if p.prompt_id not in excluded]
                if len(fresh) >= self.config.data.prompts_per_iteration:
                    prompts = fresh
                else:
                    stage_logger().warning(
                        "lineage %r has sampled %d of the %d prompts; %d fresh ones are fewer than "
                        "data.prompts_per_iteration=%d, so this run reuses all of them. Add prompts to continue "
                        "on fresh ones.",
                        record.lineage,
                        len(prompts) - len(fresh),
                        len(prompts),
                        len(fresh),
                        self.config.data.prompts_per_iteration,
                    )
            self._prompts = prompts
        return self._prompts

    def ensure_version(self, version: int) -> None:
        """Put the adapter and optimizer of `version` (-1: initial) in memory."""
        if version == self.version:
            return
        folder = self.run.checkpoint_dir(version)
        if version == INIT_VERSION:
            checkpoints.read_manifest(folder)  # the initial adapter is a complete checkpoint
        self.policy.load_adapter(folder / checkpoints.ADAPTER_FILE)
        if version == INIT_VERSION:
            self.optimizer = make_optimizer(self.policy, self.config.training)
        else:
            checkpoints.load_optimizer(folder / checkpoints.OPTIMIZER_FILE, self.optimizer)
        self.version = version


_CACHE: dict[Path, RunResources] = {}


def resources_for(run_dir: str | Path) -> RunResources:
    root = Path(run_dir).resolve()
    if root not in _CACHE:
        run = RunDir.open(root)
        config = run.stored_config()
        device = resolve_device(config.run.device)
        policy = load_policy(config.model, config.sampling.temperature, device, config.run.seed)
        _CACHE[root] = RunResources(run, config, device, policy, make_optimizer(policy, config.training))
    return _CACHE[root]


def forget(run_dir: str | Path) -> None:
    """Drop a run's cached resources (tests, or a run that finished)."""
    _CACHE.pop(Path(run_dir).resolve(), None)
