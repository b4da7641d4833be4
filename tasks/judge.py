"""Stage 2a: what the scorer reads from the rollouts' texts alone: harm (a classifier's P(label), a judge's P(unsafe)),
the judge's categories, refusal, novelty against the memory of earlier iterations; dialogues, each policy answer's
harm in the conversation up to it.

None of it depends on the policy's weights, so one step off-policy (training.max_staleness=1) judges iteration i + 1's
rollouts beside iteration i's update, with the sampling (flows/iteration.py: `SampleAhead`); the score stage then adds
what needs the weights that update writes (the KL and entropy terms) and the reward. Defense: the judge reads each
(attacker prompt, defender response) pair, told the attacker's goal.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.rollouts.dialogue import policy_rows
from redteam_grpo.core.scoring.backend import ScoringBackend
from redteam_grpo.core.scoring.novelty import novelty_scores
from redteam_grpo.core.scoring.scorers import Goal, ModelInfo, ScorerError
from redteam_grpo.core.training.rewards import unscored_share
from redteam_grpo.storage import schemas
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import JUDGE, SAMPLE, SCORE, Stage
from redteam_grpo.tasks.common import run_sharded_stage
from redteam_grpo.tasks.resources import resources_for
from redteam_grpo.tasks.sample import ATTACK_PROMPT_SEPARATOR


@dataclass(frozen=True)
class Judgements:
    """The judge stage's columns but the keys, one entry per scored row (a completion, or a whole dialogue)."""

    harm: list[float | None]
    scorer: ModelInfo
    categories: list[list[str]]
    refusal: list[bool]
    truncated: list[bool]
    novelty: list[float | None]
    embeddings: list[list[float] | None]
    turn_harm: list[list[float | None]] | None = None

    def columns(self) -> dict[str, list]:
        """The columns the judge stage writes and the score stage copies (schemas.JUDGEMENT_FIELDS)."""
        n = len(self.harm)
        return {
            "harm": self.harm,
            "scorer_name": [self.scorer.name] * n,
            "scorer_revision": [self.scorer.revision] * n,
            "scorer_kind": [self.scorer.kind] * n,
            "categories": self.categories,
            "refusal": self.refusal,
            "scorer_truncated": self.truncated,
            "novelty": self.novelty,
            "embedding": self.embeddings,
        }

    def table(self, keys: dict[str, list]) -> pa.Table:
        n = len(self.harm)
        return schemas.to_table(
            {
                **{k: keys[k] for k in schemas.KEY_COLUMNS},
                **self.columns(),
                "turn_harm": self.turn_harm if self.turn_harm is not None else [None] * n,
            },
            schemas.JUDGEMENTS,
            "judgements",
        )


def novelty_memory(
    run: RunDir, iteration: int, iterations_back: int, max_rows: int, stage: Stage = SCORE
) -> torch.Tensor | None:
    """Embeddings of the newest `max_rows` texts of the `iterations_back` iterations before this one, from `stage`'s
    files (the completions' scores; self-play: the attacker's prompts' scores). One step off-policy judges iteration
    i + 1 while i's update runs: every earlier iteration's scores are written by then."""
    rows: list[list[float]] = []
    for earlier in range(max(0, iteration - iterations_back), iteration):
        if earlier in run.recorded_iterations(stage):  # a damaged one is an error in read, never skipped
            rows.extend(e for e in run.read(stage, earlier).column("embedding").to_pylist() if e is not None)
    rows = rows[-max_rows:]
    return torch.tensor(rows, dtype=torch.float32) if rows else None


def earlier_answers_scored(
    scoring: ScoringBackend,
    messages: list[list[dict[str, str]]],
    last: list[float | None],
    goals: list[Goal | None] | None = None,
) -> list[list[float | None]]:
    """Each dialogue's harm per policy answer, each scored in the conversation up to it (one scorer call for all the
    earlier answers; `goals`: each dialogue's); the last answer's is `last`, its score in the whole dialogue."""
    asked = [(d, k) for d, dialogue in enumerate(messages) for k in range(1, len(dialogue) - 1, 2)]
    scored = scoring.score(
        [messages[d][k]["content"] for d, k in asked],
        [messages[d][:k] for d, k in asked],
        None if goals is None else [goals[d] for d, _ in asked],
    )
    if len(scored) != len(asked):
        raise RuntimeError(f"the scorer returned {len(scored)} scores for {len(asked)} earlier answers")
    per_dialogue: list[list[float | None]] = [[] for _ in messages]
    for (d, _), s in zip(asked, scored, strict=True):
        per_dialogue[d].append(s.harm)
    return [[*earlier, final] for earlier, final in zip(per_dialogue, last, strict=True)]


def goals_of(run: RunDir, mode_prompts: Stage | None, iteration: int, prompt_ids: list[str]) -> list[Goal | None]:
    """What each row's attack was after, where the mode knows it apart from the prompt: defense's defender answers
    an attacker's prompt (`goal#index`) written for a goal of the data, kept in the attack stage's `prompt` column.
    Attack mode knows none: its prompt is itself the request the policy is pushed to comply with."""
    if mode_prompts is None:
        return [None] * len(prompt_ids)
    attacks = run.read(mode_prompts, iteration).to_pydict()
    goal_text = dict(zip(attacks["prompt_id"], attacks["prompt"], strict=True))
    goals: list[Goal | None] = []
    for prompt_id in prompt_ids:
        goal_id = prompt_id.rpartition(ATTACK_PROMPT_SEPARATOR)[0]
        if goal_id not in goal_text:
            raise ValueError(f"rollout prompt {prompt_id!r} names no goal of iteration {iteration}'s attacks")
        goals.append(Goal(goal_text[goal_id]))
    return goals


def check_unscored(harm: list[float | None], limit: float, scorer: ModelInfo) -> None:
    """Stop when more of a shard went unscored than reward.max_unscored_share allows: the update would learn from the
    few rows left, and a judge that cannot be read is a misconfigured judge."""
    share = unscored_share(harm)
    if share > limit:
        raise ScorerError(
            f"{share:.0%} of {len(harm)} completions got no score from {scorer.name} "
            f"({scorer.details.get('format', scorer.kind)}): above reward.max_unscored_share={limit}. A judge whose "
            "verdicts cannot be read is answering in another format (check reward.judge_format and the model's chat "
            "template); raise the bound only if that share is expected"
        )


def judgements_stats(table: pa.Table) -> dict[str, float]:
    """What the manifest keeps with the stage: its rows and the share the scorer gave no score (the score stage's
    statistics, over the same columns, are the iteration's metrics)."""
    return {"judged": table.num_rows, "unscored_share": unscored_share(table.column("harm").to_pylist())}


@task(name="judge-shard", task_run_name="judge-{iteration}-shard-{shard}", cache_policy=NO_CACHE)
def judge_shard(run_dir: str, iteration: int, shard: int, session: str | None = None) -> tuple[str, int]:
    """Judge shard `shard`'s part of the rollouts; write its part of the judgements table. Novelty compares a
    completion with the others of its shard and with the memory of earlier iterations."""
    res = resources_for(run_dir, session)
    cfg = res.config
    r = cfg.reward
    shards = cfg.runtime.shards
    # dialogues: one row each, whose last answer the judge reads in the light of the whole dialogue
    scored_rows = policy_rows(res.run.read_part(SAMPLE, iteration, shard, shards).to_pydict())
    rollouts, messages = scored_rows.columns, scored_rows.messages
    texts = rollouts["completion_text"]
    goals = goals_of(res.run, mode_of(cfg).prompts, iteration, rollouts["prompt_id"])
    # the scorer's models are shared with what the iteration before runs meanwhile (self-play's attack_score), and a
    # tokenizer is not safe to share between threads
    with res.scoring_lock:
        scoring = res.scoring
        info = scoring.describe().scorer
        scored = scoring.score(texts, rollouts["prompt"] if messages is None else [m[:-1] for m in messages], goals)
        if len(scored) != len(texts):
            raise RuntimeError(f"scorer {info.name} returned {len(scored)} scores for {len(texts)} texts")
        harm = [s.harm for s in scored]
        check_unscored(harm, r.max_unscored_share, info)
        dialogue = cfg.dialogue
        turn_harm = None
        if messages is not None and (dialogue.rewards == "per_turn" or dialogue.score_each_turn):
            turn_harm = earlier_answers_scored(scoring, messages, harm, goals)
        n = len(texts)
        novelty: list[float | None] = [None] * n
        embeddings: list[list[float] | None] = [None] * n
        if r.novelty_weight:
            embedded = scoring.embed(texts)  # [N, D]
            memory = novelty_memory(res.run, iteration, r.novelty_memory_iterations, r.novelty_memory_size)
            novelty = list(novelty_scores(embedded, memory))
            embeddings = embedded.tolist()
    table = Judgements(
        harm=harm,
        scorer=info,
        categories=[list(s.categories) for s in scored],
        refusal=[bool(s.refusal) for s in scored],
        truncated=[bool(s.truncated) for s in scored],
        novelty=novelty,
        embeddings=embeddings,
        turn_harm=turn_harm,
    ).table(rollouts)
    path = res.run.write(JUDGE, iteration, table, res.run.part_path(JUDGE, iteration, shard, shards))
    return str(path), table.num_rows


def judge_stage(run_dir: str, iteration: int) -> str:
    """Stage 2a in `runtime.shards` shards, one per part of the rollouts (`tasks/common.py: run_sharded_stage`)."""
    res = resources_for(run_dir)
    return run_sharded_stage(res.run, JUDGE, iteration, res.config.runtime, judge_shard, judgements_stats, res.session)
