"""The modes of the pipeline, declared once: each a record of the stages one iteration runs and what else differs.

`flows/iteration.py` runs `mode.stages(config)` in order, whatever the mode; the tasks ask the record, never the
mode's name, what to do differently (where the policy's prompts come from, which adapters sit on the base and
which of them learn, which learners GRPO updates; self-play is the defense record with two learners). Adding a mode
is one `Mode` record here plus its new stages (`storage/stages.py`) and their tasks (`flows/iteration.py:
STAGE_TASKS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from redteam_grpo.core.config import Config, ConfigError, mode_defaults
from redteam_grpo.core.metrics.registry import log_line
from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE
from redteam_grpo.core.training.staleness import INITIAL_VERSION
from redteam_grpo.storage.stages import (
    ATTACK,
    ATTACK_TRAIN_STEP,
    ATTACKER_LEARNER,
    CHECKPOINT,
    HARDEN,
    JUDGE,
    POLICY,
    SAMPLE,
    SCORE,
    SFT_TRAIN,
    TRAIN_STEP,
    Learner,
    Stage,
)


def _sft_line(epoch: int, row: dict[str, Any]) -> str:
    return (
        f"epoch {epoch}: train loss {row['train_loss']:.4f}  eval loss {row['eval_loss']:.4f}  "
        f"({row['steps']} steps, {row['seconds']:.1f} s)"
    )


@dataclass(frozen=True)
class Mode:
    name: str  # run.mode
    command: str  # the CLI command that runs and resumes it
    label: str  # the progress bar's name for it
    title: str  # what a report calls a run of it
    learners: Callable[[Config], tuple[Learner, ...]]  # the roles GRPO updates, in order (none: SFT)
    before: tuple[Stage, ...]  # stages before the learners' (defense: the attacker writes the prompts)
    own_update: Stage | None  # a mode's update that is not GRPO's (SFT's epoch), else None
    metrics: Stage  # the stage whose one row is the iteration's metrics: progress, early stopping, checkpoint
    summary: tuple[str, ...]  # the metrics a checkpoint's manifest repeats
    progress: str  # the metric the progress bar shows
    data: Literal["prompts", "pairs"]  # what data.source holds: prompts, or SFT's (input, target) pairs
    prompts: Stage | None  # where the policy's prompts come from: a stage's output, or None: data.source drawn
    roles: tuple[str, ...]  # the adapters on the one base, the trained policy's first (defense: the attacker's beside)
    early_stopping: bool  # run.early_stop_* apply
    artifacts: bool  # each iteration publishes its metrics and top completions as a Prefect artifact
    evaluation: Literal["redteam", "defense", "active"] | None  # what `evaluate` measures (None: refused)
    describe: Callable[[int, dict[str, Any]], str]  # the log line of an iteration's metrics row
    # restarts(cfg, role, iteration): whether a learning role starts `iteration` over from its initial checkpoint,
    # with a fresh optimizer, rather than from the weights after iteration - 1 (a schedule of the mode's own)
    restarts: Callable[[Config, str, int], bool] = lambda cfg, role, iteration: False
    # evaluation None: what `evaluate` tells the person who asks it to evaluate such a run, and where to look instead
    not_evaluated: str = ""
    # keeps(cfg, iteration): whether the checkpoint of `iteration` outlives run.keep_checkpoints' pruning, because the
    # mode's evaluation reads it (Active Attacks: each hardening's victim)
    keeps: Callable[[Config, int], bool] = lambda cfg, iteration: False

    def stages(self, cfg: Config) -> tuple[Stage, ...]:
        """One iteration's stages in the order they run: the mode's first stages, each learner's (the policy's,
        then, with self-play, the attacker's, which reuses the attacker's stage as its rollouts), the checkpoint."""
        stages = list(self.before)
        for learner in self.learners(cfg):
            for stage in (learner.rollouts, learner.judged, learner.scores, learner.advantages, learner.update):
                if stage is not None and stage not in stages:
                    stages.append(stage)
        if self.own_update is not None:
            stages.append(self.own_update)
        return (*stages, CHECKPOINT)

    def ahead_stages(self, cfg: Config) -> tuple[Stage, ...]:
        """The stages of an iteration that need no weights of the update before it, beyond those its rollouts are
        drawn with: the mode's first stages, the first learner's rollouts and the judge's reading of them. One step
        off-policy runs them beside the update before (flows/iteration.py: `SampleAhead`)."""
        first, stages = self.learners(cfg)[0], self.stages(cfg)
        return stages[: stages.index(first.judged or first.rollouts) + 1]

    def learning_roles(self, cfg: Config) -> tuple[str, ...]:
        """The roles whose weights change from iteration to iteration: GRPO's learners, and the policy a mode's own
        update trains (SFT). Any other role on the base keeps its initial checkpoint's weights (defense's attacker
        without self-play)."""
        learning = tuple(learner.role for learner in self.learners(cfg))
        return learning if self.own_update is None else (DEFAULT_ROLE, *learning)

    def update_stages(self, cfg: Config) -> tuple[Stage, ...]:
        """Every stage that writes weights into an iteration's checkpoint folder."""
        own = (self.own_update,) if self.own_update is not None else ()
        return (*(learner.update for learner in self.learners(cfg)), *own)

    def starting_version(self, cfg: Config, role: str, iteration: int) -> int:
        """The version of the weights `role` starts iteration `iteration` from, which its rows of that iteration are
        drawn by: those after iteration - 1 where it learns, unless the mode restarts it there; else (a role that
        does not learn, or one restarted) the initial checkpoint's (-1)."""
        if role not in self.learning_roles(cfg) or self.restarts(cfg, role, iteration):
            return INITIAL_VERSION
        return iteration - 1

    def staleness(self, cfg: Config) -> tuple[int, str | None]:
        """The staleness this run's updates train at: training.max_staleness where the pipeline can draw iteration
        i + 1 (its stages before the learners' and its rollouts: defense's attack and sample) while iteration i's
        updates run, else 0 (synchronous); and, where it asked for more than it gets, the one line that says why."""
        asked = cfg.training.max_staleness
        if asked == 0:
            return 0, None
        if not self.learners(cfg):
            why = "it samples nothing"
        elif cfg.sampling.backend != "vllm":
            why = (
                "the in-process sampler draws with the trainer's own weights, which the update is changing; the vLLM "
                "sampler (sampling.backend=vllm) draws beside it"
            )
        elif self.own_update is not None:
            why = f"its {self.own_update.name} stage changes the weights the next iteration draws with"
        else:
            return asked, None
        return 0, f"training.max_staleness={asked}: {self.name} runs synchronously: {why}"

    def defaults(self) -> dict[str, Any]:
        """The nested config defaults of this mode (core/config.py: MODE_DEFAULTS), a copy."""
        return mode_defaults(self.name)


ATTACK_MODE = Mode(
    name="attack",
    command="run",
    label="GRPO",
    title="Red-team GRPO run",
    learners=lambda cfg: (POLICY,),
    before=(),
    own_update=None,
    metrics=TRAIN_STEP,
    summary=("reward_mean", "harm_mean", "repetition_mean", "kl_base_mean"),
    progress="reward_mean",
    data="prompts",
    prompts=None,
    roles=(DEFAULT_ROLE,),
    early_stopping=True,
    artifacts=True,
    evaluation="redteam",
    describe=log_line,
)
DEFENSE_MODE = Mode(
    name="defense",
    command="defense",
    label="defense",
    title="Defense GRPO run",
    learners=lambda cfg: (POLICY, ATTACKER_LEARNER) if cfg.defense.self_play else (POLICY,),
    before=(ATTACK,),
    own_update=None,
    metrics=TRAIN_STEP,
    summary=ATTACK_MODE.summary,
    progress="reward_mean",
    data="prompts",
    prompts=ATTACK,
    roles=(DEFAULT_ROLE, ATTACKER),
    early_stopping=True,
    artifacts=True,
    evaluation="defense",
    describe=log_line,
)
SFT_MODE = Mode(
    name="sft",
    command="sft",
    label="SFT",
    title="Attacker SFT run",
    learners=lambda cfg: (),
    before=(),
    own_update=SFT_TRAIN,
    metrics=SFT_TRAIN,
    summary=("train_loss", "eval_loss"),
    progress="train_loss",
    data="pairs",
    prompts=None,
    roles=(DEFAULT_ROLE,),
    early_stopping=False,
    artifacts=False,
    evaluation=None,
    describe=_sft_line,
    not_evaluated=(
        "an SFT run: its held-out loss is in sft_metrics.parquet (redteam-grpo inspect); evaluate the defense run that "
        "uses it as its attacker"
    ),
)


def _hardening_line(iteration: int, row: dict[str, Any]) -> str:
    return f"attacker: {log_line(iteration, row)}"


def _after_a_hardening(cfg: Config, role: str, iteration: int) -> bool:
    """Active Attacks' attacker starts each round after the first over from its initial checkpoint."""
    a = cfg.active
    return role == ATTACKER and a.reset_attacker and iteration > 0 and a.hardens_after(iteration - 1)


ACTIVE_MODE = Mode(
    name="active",
    command="active",
    label="active",
    title="Active Attacks run",
    # the attacker learns by GRPO on the victim's responses (self-play's stages); the victim learns by hardening only
    learners=lambda cfg: (ATTACKER_LEARNER,),
    before=(ATTACK, SAMPLE, JUDGE, SCORE),
    own_update=HARDEN,
    metrics=ATTACK_TRAIN_STEP,
    summary=ATTACK_MODE.summary,
    progress="harm_mean",
    data="prompts",
    prompts=ATTACK,
    roles=(DEFAULT_ROLE, ATTACKER),
    early_stopping=False,
    artifacts=False,
    evaluation="active",
    describe=_hardening_line,
    restarts=_after_a_hardening,
    keeps=lambda cfg, iteration: cfg.active.hardens_after(iteration),  # each round's victim, which evaluate reads
)
MODES: dict[str, Mode] = {m.name: m for m in (ATTACK_MODE, DEFENSE_MODE, SFT_MODE, ACTIVE_MODE)}


def mode_named(name: str) -> Mode:
    if name not in MODES:
        raise ConfigError(f"unknown run.mode {name!r}: one of {', '.join(MODES)}")
    return MODES[name]


def mode_of(cfg: Config) -> Mode:
    """The record of the mode `cfg` runs in (run.mode)."""
    return mode_named(cfg.run.mode)
