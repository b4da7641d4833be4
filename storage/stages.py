"""The stages of an iteration, declared once: name, file, schema, SQL view and what each holds.

Everything that touches a stage's output — the run directory, the manifest, the stage skeleton in `tasks/`,
DuckDB views, lineage, export, reports, artifacts — looks it up here, so a stage cannot have one name in the
manifest, another on disk and a third in SQL. Which of them a mode runs, in which order, is its `Mode` record's
(storage/modes.py); a `Learner` names the stages and files of one role that GRPO trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from redteam_grpo.core.config import Config
from redteam_grpo.core.models.roles import ATTACKER, ATTACKER_SPEAKER, DEFAULT_ROLE, POLICY_SPEAKER
from redteam_grpo.storage import checkpoints, schemas


@dataclass(frozen=True)
class Stage:
    name: str  # the manifest's and Prefect's name of the stage
    file: str | None  # its Parquet file inside the iteration folder (None: writes checkpoint files only)
    schema: pa.Schema | None
    view: str | None  # the DuckDB view over every completed iteration's file
    description: str

    @property
    def label(self) -> str:
        return self.file or self.name


ATTACK = Stage(
    "attack",
    "attacks.parquet",
    schemas.ROLLOUTS,
    "attacks",
    "defense: the attacker's prompts, prompt_id the goal: goal ids as fed, prompt ids as drawn, sampling logprobs",
)
SAMPLE = Stage(
    "sample",
    "rollouts.parquet",
    schemas.ROLLOUTS,
    "rollouts",
    "G completions per prompt: prompt ids as fed, completion ids as drawn, one sampling logprob per token",
)
JUDGE = Stage(
    "judge",
    "judgements.parquet",
    schemas.JUDGEMENTS,
    "judgements",
    "what the scorer reads from the texts alone: harm, judge categories, refusal, novelty; needs no policy weights, "
    "so it runs ahead with the next iteration's rollouts (training.max_staleness)",
)
SCORE = Stage(
    "score",
    "scores.parquet",
    schemas.SCORES,
    "scores",
    "the judge stage's columns, repetition, KL to the base, and the composite reward",
)
ADVANTAGE = Stage(
    "advantage", "advantages.parquet", schemas.ADVANTAGES, "advantages", "group-relative advantage of every completion"
)
TRAIN_STEP = Stage(
    "train_step",
    "train_metrics.parquet",
    schemas.TRAIN_METRICS,
    "metrics",
    "one row per iteration: every metric of core/metrics/registry.py; the updated adapter and optimizer go to the "
    "checkpoint",
)
ATTACK_SCORE = Stage(
    "attack_score",
    "attack_scores.parquet",
    schemas.SCORES,
    "attack_scores",
    "self-play: each attacker prompt's reward: the judge's mean P(unsafe) over the defender's responses, novelty "
    "against collapse, KL(attacker || base)",
)
ATTACK_ADVANTAGE = Stage(
    "attack_advantage",
    "attack_advantages.parquet",
    schemas.ADVANTAGES,
    "attack_advantages",
    "self-play: group-relative advantage of every attacker prompt (a goal's prompts form a group)",
)
ATTACK_TRAIN_STEP = Stage(
    "attack_train_step",
    "attack_train_metrics.parquet",
    schemas.TRAIN_METRICS,
    "attack_metrics",
    "self-play: the attacker's update; its metrics row; the attacker's adapter and optimizer go to the checkpoint",
)
SFT_TRAIN = Stage(
    "sft_train",
    "sft_metrics.parquet",
    schemas.SFT_METRICS,
    "sft_metrics",
    "sft: one epoch over the training pairs, loss on target tokens only; the held-out loss after it",
)
HARDEN = Stage(
    "harden",
    "harden_metrics.parquet",
    schemas.HARDEN_METRICS,
    "harden_metrics",
    "active: at a round's last iteration the victim's LoRA SFT on the attacks found so far paired with refusals; "
    "every iteration the victim's adapter and optimizer go to the checkpoint",
)
CHECKPOINT = Stage(
    "checkpoint", None, None, None, "seals the iteration's checkpoint: its manifest, written last over the weights"
)

# Every stage in the order stages run within an iteration; each mode runs a subsequence of it, so one order
# serves the manifest, verification and redo of every mode.
ALL_STAGES: tuple[Stage, ...] = (
    ATTACK,
    SAMPLE,
    JUDGE,
    SCORE,
    ADVANTAGE,
    TRAIN_STEP,
    ATTACK_SCORE,
    ATTACK_ADVANTAGE,
    ATTACK_TRAIN_STEP,
    HARDEN,
    SFT_TRAIN,
    CHECKPOINT,
)
TABLE_STAGES: tuple[Stage, ...] = tuple(s for s in ALL_STAGES if s.file is not None)
BY_NAME: dict[str, Stage] = {s.name: s for s in ALL_STAGES}
BY_VIEW: dict[str, Stage] = {s.view: s for s in TABLE_STAGES if s.view}


@dataclass(frozen=True)
class Learner:
    """A role that GRPO trains and everything that differs between roles: the adapter it trains, the stages of its
    rollouts, judgements, scores, advantages and update, the checkpoint files of its adapter and optimizer, its group
    size and completion length. Red-team and defense runs train `POLICY` (the default adapter: the attacked model, or
    the defender); self-play also trains `ATTACKER_LEARNER`."""

    role: str  # the adapter's name on the policy (core/models/roles.py)
    rollouts: Stage
    judged: Stage | None  # what the scorer read from its rows' texts alone (None: its scores stage reads others')
    scores: Stage
    advantages: Stage
    update: Stage
    adapter_file: str
    optimizer_file: str
    group_size: Callable[[Config], int]  # the completions of one group: the advantage's baseline
    max_new_tokens: Callable[[Config], int]  # the longest completion it samples
    per_turn: bool  # dialogue.rewards=per_turn applies: its rollouts are dialogues rewarded turn by turn
    speaker: str  # the `speaker` of the rollouts rows it drew (a dialogue also holds the other speaker's)


POLICY = Learner(
    DEFAULT_ROLE,
    SAMPLE,
    JUDGE,
    SCORE,
    ADVANTAGE,
    TRAIN_STEP,
    *checkpoints.ROLE_FILES[DEFAULT_ROLE],
    group_size=lambda cfg: cfg.sampling.group_size,
    max_new_tokens=lambda cfg: cfg.sampling.max_new_tokens,
    per_turn=True,
    speaker=POLICY_SPEAKER,
)
ATTACKER_LEARNER = Learner(
    ATTACKER,
    ATTACK,
    None,  # its harm is the judge's of the defender's answers to its prompts, read from the scores file
    ATTACK_SCORE,
    ATTACK_ADVANTAGE,
    ATTACK_TRAIN_STEP,
    *checkpoints.ROLE_FILES[ATTACKER],
    group_size=lambda cfg: cfg.attacker_settings.prompts_per_goal,  # a goal's prompts form a group
    max_new_tokens=lambda cfg: cfg.attacker_settings.attacker_max_new_tokens,
    per_turn=False,
    speaker=ATTACKER_SPEAKER,
)
LEARNERS: dict[str, Learner] = {learner.role: learner for learner in (POLICY, ATTACKER_LEARNER)}
