"""One sampler interface for the sampling sites that choose a model by name: the base (every adapter off), the trained
adapter, or the attacker's. `InProcessSampler` draws with `core/rollouts/sampling.py` under the matching adapter
context; `EngineSampler` asks the vLLM server for the same names, each adapter exported from the weights in memory and
loaded under a name that is a digest of them (`server/vllm_client.py: adapter_name`). Evaluation samples through it, so
sampling.backend=vllm means the engine there as in the stages.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from redteam_grpo.core.data.sources import Prompt
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import Policy, resolve_model_name
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.rollouts.sampling import Completion, sample_completions
from redteam_grpo.core.scoring.backend import ScoringBackend
from redteam_grpo.core.scoring.scorers import Goal, TextScore
from redteam_grpo.server.vllm_client import PEFT_ADAPTER_FILE, VllmSampler, adapter_name
from redteam_grpo.storage.rundir import RunDir, checkpoint_name

BASE = "base"  # the model with every adapter off: the reference, and evaluation's "base"


class Sampler(Protocol):
    def sample(
        self, who: str, prompt_ids: Sequence[Sequence[int]], group_size: int, max_new_tokens: int, seed: int
    ) -> list[Completion]:
        """`group_size` completions of every prompt from `who` (BASE or an adapter's role), in prompt order."""
        ...


@dataclass
class InProcessSampler:
    policy: Policy
    batch_size: int

    def sample(self, who, prompt_ids, group_size, max_new_tokens, seed):
        context = self.policy.reference() if who == BASE else self.policy.role(who)
        with context:
            return sample_completions(self.policy, prompt_ids, group_size, max_new_tokens, self.batch_size, seed)


def _swapped_in(folder: Path, write: Callable[[Path], None]) -> Path:
    """`write(staging)` fills a staging folder beside `folder`, which then replaces `folder` whole: the engine never
    reads a half-written adapter. Returns the adapter's weights file."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder / PEFT_ADAPTER_FILE


def export_adapter(policy: Policy, role: str, folder: Path) -> Path:
    """`role`'s adapter, as the weights in memory hold it, in PEFT's format in `folder`; its weights."""

    def write(staging: Path) -> None:
        policy.model.save_pretrained(staging, selected_adapters=[role], save_embedding_layers=False)
        if role != DEFAULT_ROLE:  # PEFT writes any other adapter into a subfolder named after it
            moved = staging.with_name(staging.name + ".role")
            shutil.rmtree(moved, ignore_errors=True)
            (staging / role).rename(moved)
            shutil.rmtree(staging)
            moved.rename(staging)

    return _swapped_in(folder, write)


def export_checkpoint_adapter(policy: Policy, role: str, adapter_file: Path, folder: Path) -> Path:
    """`role`'s adapter as a checkpoint holds it (`adapter_file`, PEFT's own key names) in PEFT's format in `folder`,
    without touching the weights in memory: one step off-policy samples with the adapter of an earlier iteration while
    the update changes those (training.max_staleness); its weights."""

    def write(staging: Path) -> None:
        staging.mkdir()
        policy.model.peft_config[role].save_pretrained(str(staging))  # the adapter's shape: read, never changed
        shutil.copyfile(adapter_file, staging / PEFT_ADAPTER_FILE)

    return _swapped_in(folder, write)


@dataclass
class EngineSampler:
    """The vLLM server at `client`, serving `base_model`; adapters are exported under `folder` as they are asked for."""

    client: VllmSampler
    policy: Policy
    base_model: str
    folder: Path
    owner: str  # names the adapters (with their version and digest): the run, and what it samples for
    version: int
    temperature: float
    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_run(cls, url: str, policy: Policy, model: str, folder: Path, owner: str, version: int, temperature: float):
        client = VllmSampler(url)
        client.wait_ready()
        return cls(client, policy, resolve_model_name(model), folder, owner, version, temperature)

    def adapter(self, who: str) -> str:
        if who == BASE:
            return self.base_model
        if who not in self.names:
            weights = export_adapter(self.policy, who, self.folder / who)
            owner = self.owner if who == DEFAULT_ROLE else f"{self.owner}-{who}"
            self.names[who] = adapter_name(owner, self.version, weights)
            self.client.load_adapter(self.names[who], weights.parent)
        return self.names[who]

    def sample(self, who, prompt_ids, group_size, max_new_tokens, seed):
        return self.client.sample(
            self.adapter(who),
            prompt_ids,
            group_size,
            max_new_tokens,
            self.temperature,
            seed,
            self.policy.end_of_turn_ids,
            self.policy.distribution.suppressed_ids,
        )


def evaluation_sampler(
    run: RunDir, policy: Policy, iteration: int, variant: str = ""
) -> InProcessSampler | EngineSampler:
    """How an evaluation of `run`'s checkpoint `iteration` samples: as the run did (sampling.backend), the adapters in
    `policy` (loaded from that checkpoint) exported for the engine under RUN/sampler/eval-<checkpoint><variant>/; a
    `variant` names adapters the evaluation loaded or trained itself (Active Attacks' cross-attack table)."""
    cfg = run.stored_config()
    if cfg.sampling.backend != "vllm":
        return InProcessSampler(policy, cfg.sampling.batch_size)
    folder = run.sampler_dir / f"eval-{checkpoint_name(iteration)}{variant}"
    owner = f"{run.run_id}-eval"
    return EngineSampler.for_run(
        cfg.sampling.vllm_url, policy, cfg.model.policy, folder, owner, iteration, cfg.sampling.temperature
    )


@dataclass(frozen=True)
class Answers:
    """A sampler's answers to a set of prompts: the completions (each names its prompt by `prompt_index`), the
    prompt ids as fed and the decoded texts, in one order."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[Completion]
    texts: list[str]

    def prompt_of(self, completion: Completion) -> Prompt:
        return self.prompts[completion.prompt_index]

    def scored(self, scoring: ScoringBackend, goals: Mapping[str, Goal] | None = None) -> list[TextScore]:
        """The scorer's verdict on each answer, in the context of the prompt it answers and, where `goals` names
        one for its prompt's id, of the goal the prompt was written for."""
        prompts = [self.prompt_of(c) for c in self.completions]
        told = None if goals is None else [goals.get(p.prompt_id) for p in prompts]
        return scoring.score(self.texts, [p.text for p in prompts], told)


def answers(
    sampler: Sampler,
    who: str,
    tokenizer,
    prompts: list[Prompt],
    system_prompt: str | None,
    samples: int,
    max_new_tokens: int,
    seed: int,
) -> Answers:
    """`samples` answers of `who` (BASE or an adapter's role) to each prompt, chat-formatted with `system_prompt`:
    what every evaluation set is sampled with."""
    ids = [format_prompt_ids(tokenizer, p.text, system_prompt) for p in prompts]
    completions = sampler.sample(who, ids, samples, max_new_tokens, seed)
    texts = tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
    return Answers(list(prompts), ids, completions, texts)
