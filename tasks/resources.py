"""What the stages of one run share inside a process: the loaded policy, optimizer, scorer and prompts.

Stages exchange files, not objects; this cache only saves reloading a model between stages. It tracks which
update the in-memory adapter came from (`version`), and a stage that needs another version loads it from the
run directory, so a resumed or re-run stage always computes on the weights it would have had.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from redteam_grpo.core.config import Config
from redteam_grpo.core.data.sources import Prompt, load_prompts
from redteam_grpo.core.models.policy import Policy, load_policy, resolve_device
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.scoring.backend import ScoringBackend
from redteam_grpo.core.training.train import make_optimizer
from redteam_grpo.server.vllm_client import PEFT_ADAPTER_FILE, VllmSampler, adapter_name
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.lineage import fresh_prompts
from redteam_grpo.storage.location import absolute, location
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import INIT_VERSION, DamagedRunError, RunDir
from redteam_grpo.tasks.engine import export_adapter, export_checkpoint_adapter
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.scoring import scoring_backend


@dataclass
class RoleWeights:
    """One adapter on the base, in this process: the iteration whose update made the weights in memory (None: the
    fresh LoRA init, tied to no checkpoint; -1: the initial checkpoint's) and, where the role learns, its optimizer."""

    version: int | None = None
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)


@dataclass
class RunResources:
    run: RunDir
    config: Config
    device: torch.device
    policy: Policy
    roles: dict[str, RoleWeights]  # every adapter on the base (storage/modes.py: Mode.roles), looked up by role
    _scoring: ScoringBackend | None = field(default=None, repr=False)
    _embedder: object | None = field(default=None, repr=False)
    _prompts: list[Prompt] | None = field(default=None, repr=False)
    _vllm: VllmSampler | None = field(default=None, repr=False)
    _served: dict[str, str] = field(default_factory=dict, repr=False)  # the adapter name the server holds per role
    # per role, the checkpoint version whose adapter `vllm_checkpoint_adapter` exported last
    _exported: dict[str, int] = field(default_factory=dict, repr=False)
    session: str = field(default_factory=lambda: uuid.uuid4().hex)  # the owner's run of the flow these serve
    # held by whoever uses the scorer's or the embedder's models: one step off-policy judges the next iteration in a
    # thread beside this one's stages, and a tokenizer is not safe to share between threads
    scoring_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @property
    def scoring(self) -> ScoringBackend:
        """In-process scorers, or the reward server's client when reward.url is set (checked to serve the same)."""
        with self.scoring_lock:  # built once, whichever thread asks first
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

    def optimizer_for(self, role: str) -> torch.optim.Optimizer:
        optimizer = self.roles[role].optimizer
        if optimizer is None:
            raise RuntimeError(f"the {role!r} adapter does not learn in this {self.config.run.mode} run: no optimizer")
        return optimizer

    def ensure_role(self, role: str, version: int) -> None:
        """`role`'s adapter, and its optimizer where it learns, in memory as iteration `version` + 1 starts from them:
        as they were after iteration `version`'s update (-1: the initial checkpoint). A role that does not learn
        (defense's attacker without self-play), or one its mode restarts at `version` + 1 (`Mode.restarts`), holds
        its initial checkpoint's weights, the latter with a fresh optimizer."""
        cfg = self.config
        mode = mode_of(cfg)
        learns = role in mode.learning_roles(cfg)
        wanted = mode.starting_version(cfg, role, version + 1)
        held = self.roles[role]
        if wanted == held.version:
            return
        folder = self.run.checkpoint_dir(wanted)
        self._check_checkpoint(folder, wanted)
        adapter_file, optimizer_file = checkpoints.ROLE_FILES[role]
        self.policy.load_adapter(folder / adapter_file, role)
        if learns:
            with self.policy.role(role):
                if wanted == INIT_VERSION or held.optimizer is None:
                    held.optimizer = make_optimizer(self.policy, cfg.training)
            if wanted != INIT_VERSION:
                checkpoints.load_optimizer(folder / optimizer_file, held.optimizer)
        held.version = wanted

    def ensure_version(self, version: int) -> None:
        """Every adapter on the base, with its optimizer, as after iteration `version`'s update (-1: initial)."""
        for role in reversed(mode_of(self.config).roles):  # the policy's last, as its stages expect it active
            self.ensure_role(role, version)

    def holds(self, role: str, version: int | None) -> None:
        """Record that memory holds `role`'s weights after iteration `version` (None: weights no checkpoint has)."""
        self.roles[role].version = version

    @property
    def embedder(self):
        """Self-play: the sentence embedder of the attacker's novelty term (reward.embedder), loaded once."""
        if self._embedder is None:
            from redteam_grpo.core.scoring.novelty import SentenceEmbedder

            self._embedder = SentenceEmbedder(self.config.reward.embedder, self.device, self.config.reward.batch_size)
        return self._embedder

    def _check_checkpoint(self, folder: Path, version: int) -> None:
        try:
            checkpoints.read_manifest(folder)  # complete, and every file matches its checksum
        except checkpoints.CheckpointError as exc:
            if version == INIT_VERSION:
                raise DamagedRunError(
                    f"{exc}: the adapter this run started from is damaged. Resume the run to write it again "
                    f"(redteam-grpo {self.run.command} --resume {self.run.root} --redo 0)"
                ) from None
            raise DamagedRunError(
                f"{exc}: the weights after iteration {version}, which every later iteration builds on, are damaged. "
                f"Recompute them with: redteam-grpo {self.run.command} --resume {self.run.root} "
                f"--redo {version}/{self.run.update_stage.name}"
            ) from None

    @property
    def vllm(self) -> VllmSampler:
        """sampling.backend=vllm: the client of the vLLM server, once it answers /health."""
        if self._vllm is None:
            sampler = VllmSampler(self.config.sampling.vllm_url)
            sampler.wait_ready()
            self._vllm = sampler
        return self._vllm

    def vllm_adapter(self, version: int, role: str = DEFAULT_ROLE) -> str:
        """sampling.backend=vllm: `role`'s adapter after `version` (-1: initial), exported in PEFT's format to the
        run's `sampler/` folder and loaded in the vLLM server; its name, which names these very weights (a digest),
        so a response can be checked against it. The role's adapter of the version before is unloaded; the other
        role's stays (defense: the attacker and the defender are two adapters on the one served base)."""
        self.ensure_version(version)
        folder = self._sampler_folder(version, role)
        # written anew each time from the weights in memory (a redone iteration has new ones)
        export_adapter(self.policy, role, folder)
        return self._serve(version, role, folder)

    def vllm_checkpoint_adapter(self, version: int, role: str = DEFAULT_ROLE) -> str:
        """As `vllm_adapter`, from the sealed checkpoint of `version` on disk, never from memory: one step off-policy
        samples with it while an update changes the weights in memory (training.max_staleness). Exported once per
        version in this process: a resume exports it again from the same checkpoint."""
        folder = self._sampler_folder(version, role)
        if self._exported.get(role) != version:
            checkpoint = self.run.checkpoint_dir(version)
            self._check_checkpoint(checkpoint, version)
            export_checkpoint_adapter(self.policy, role, checkpoint / checkpoints.ROLE_FILES[role][0], folder)
            self._exported[role] = version
        return self._serve(version, role, folder)

    def _sampler_folder(self, version: int, role: str) -> Path:
        stem = "adapter" if role == DEFAULT_ROLE else f"{role}-adapter"
        return self.run.sampler_dir / (f"{stem}-init" if version == INIT_VERSION else f"{stem}-{version:04d}")

    def _serve(self, version: int, role: str, folder: Path) -> str:
        """The adapter in `folder` loaded in the vLLM server under the digest of its weights, the role's earlier one
        unloaded; its name."""
        owner = self.run.run_id if role == DEFAULT_ROLE else f"{self.run.run_id}-{role}"
        name = adapter_name(owner, version, folder / PEFT_ADAPTER_FILE)
        stale = self._served.get(role)
        if stale is not None and stale != name and stale in self.vllm.loaded:
            self.vllm.unload_adapter(stale)
        self.vllm.load_adapter(name, folder)
        self._served[role] = name
        return name


_CACHE: dict[Path, RunResources] = {}


def resources_for(run_dir: str | Path, session: str | None = None) -> RunResources:
    """The run's resources in this process, built on first use. `session`: the owner's session (its
    `RunResources.session`), passed to another process's shard task: what that process cached for an earlier
    session (the same run resumed or redone, with other weights behind the same version numbers) is dropped."""
    root = absolute(location(run_dir))
    if session is not None and root in _CACHE and _CACHE[root].session != session:
        del _CACHE[root]
    if root not in _CACHE:
        run = RunDir.open(root)
        config = run.stored_config()
        device = resolve_device(config.run.device)
        policy = load_policy(config.model, config.sampling.temperature, device, config.run.seed)
        roles = {DEFAULT_ROLE: RoleWeights(optimizer=make_optimizer(policy, config.training))}
        for role in mode_of(config).roles[1:]:
            # zero-initialised (LoRA B = 0): the base, until the initial checkpoint's weights are loaded
            policy.add_role(role)
            roles[role] = RoleWeights()
        _CACHE[root] = RunResources(run, config, device, policy, roles)
        if session is not None:
            _CACHE[root].session = session
    return _CACHE[root]


def forget(run_dir: str | Path) -> None:
    """Drop a run's cached resources (tests, or a run that finished)."""
    _CACHE.pop(absolute(location(run_dir)), None)
