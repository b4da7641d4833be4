"""What the stages of one run share inside a process: the loaded policy, optimizer, scorer and prompts.

Stages exchange files, not objects; this cache only saves reloading a model between stages. It tracks which
update the in-memory adapter came from (`version`), and a stage that needs another version loads it from the
run directory, so a resumed or re-run stage always computes on the weights it would have had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from redteam_grpo.core.config import Config
from redteam_grpo.core.data import Prompt, load_prompts
from redteam_grpo.core.policy import ATTACKER, Policy, load_policy, resolve_device
from redteam_grpo.core.scoring import ScoringBackend
from redteam_grpo.core.train import make_optimizer
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.lineage import fresh_prompts
from redteam_grpo.storage.rundir import INIT_VERSION, DamagedRunError, RunDir
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.scoring import scoring_backend


@dataclass
class RunResources:
    run: RunDir
    config: Config
    device: torch.device
    policy: Policy
    optimizer: torch.optim.Optimizer
    version: int | None = None  # None: the fresh LoRA init, not yet tied to a checkpoint
    _scoring: ScoringBackend | None = field(default=None, repr=False)
    _attacker_loaded: bool = field(default=False, repr=False)
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
            prompts, warning = fresh_prompts(self.run, load_prompts(self.config.data), self.config.data)
            if warning:
                stage_logger().warning(warning)
            self._prompts = prompts
        return self._prompts

    @property
    def attacker_system_prompt(self) -> str | None:
        """Defense: the system prompt the attacker's goals are formatted with, as the initial checkpoint records."""
        return checkpoints.read_manifest(self.run.checkpoint_dir(INIT_VERSION))["attacker"]["system_prompt"]

    def ensure_attacker(self) -> None:
        """Defense: the attacker's adapter of the initial checkpoint in memory (frozen: loaded once)."""
        if self.config.run.mode != "defense" or self._attacker_loaded:
            return
        folder = self.run.checkpoint_dir(INIT_VERSION)
        try:
            checkpoints.read_manifest(folder)
        except checkpoints.CheckpointError as exc:
            raise DamagedRunError(
                f"{exc}: the attacker's adapter is copied there when the run starts. Resume the run to write it again "
                f"(redteam-grpo defense --resume {self.run.root} --redo 0)"
            ) from None
        self.policy.load_adapter(folder / checkpoints.ATTACKER_FILE, ATTACKER)
        self._attacker_loaded = True

    def ensure_version(self, version: int) -> None:
        """Put the adapter and optimizer of `version` (-1: initial) in memory (and, in defense, the attacker)."""
        self.ensure_attacker()
        if version == self.version:
            return
        folder = self.run.checkpoint_dir(version)
        try:
            checkpoints.read_manifest(folder)  # complete, and every file matches its checksum
        except checkpoints.CheckpointError as exc:
            if version == INIT_VERSION:
                raise DamagedRunError(
                    f"{exc}: the adapter this run started from is damaged. Resume the run to write it again "
                    f"(redteam-grpo run --resume {self.run.root} --redo 0/sample)"
                ) from None
            raise DamagedRunError(
                f"{exc}: the weights after iteration {version}, which every later iteration builds on, are damaged. "
                f"Recompute them with: redteam-grpo run --resume {self.run.root} --redo {version}/train_step"
            ) from None
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
        if config.run.mode == "defense":
            policy.add_role(
                ATTACKER
            )  # zero-initialised (LoRA B = 0): the base, until the initial checkpoint's is loaded
        _CACHE[root] = RunResources(run, config, device, policy, make_optimizer(policy, config.training))
    return _CACHE[root]


def forget(run_dir: str | Path) -> None:
    """Drop a run's cached resources (tests, or a run that finished)."""
    _CACHE.pop(Path(run_dir).resolve(), None)
