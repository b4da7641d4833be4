"""Stage 2: score completions (harm, judge categories, refusal, novelty), repetition of completion tokens,
KL to the base, entropy, and the composite reward. Every component is kept in the scores file.

Defense runs the same stage: the judge scores each (attacker prompt, defender response) pair, and the reward's
weights make it the defense reward: safety − entropy − refusal − KL (reward.safety_weight, entropy_weight,
refusal_weight, kl_weight; a refusal costs less than an unsafe answer and more than a safe one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.models.policy import Policy
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.rollouts.dialogue import policy_rows
from redteam_grpo.core.scoring.backend import ScoringBackend
from redteam_grpo.core.scoring.novelty import novelty_scores
from redteam_grpo.core.scoring.scorers import Goal, ModelInfo, ScorerError
from redteam_grpo.core.tokens.logprobs import masked_mean
from redteam_grpo.core.training.batching import micro_batches
from redteam_grpo.core.training.kl import policy_entropy_reference_logprobs, sequence_kl
from redteam_grpo.core.training.rewards import (
    RewardTerms,
    ScoreStats,
    composite_reward,
    discounted_returns,
    repetition_ratios,
    score_stats,
    turn_rewards,
    unscored_share,
)
from redteam_grpo.storage import schemas
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SAMPLE, SCORE, Stage
from redteam_grpo.tasks.common import run_sharded_stage
from redteam_grpo.tasks.resources import RunResources, resources_for
from redteam_grpo.tasks.sample import ATTACK_PROMPT_SEPARATOR


def novelty_memory(
    run: RunDir, iteration: int, iterations_back: int, max_rows: int, stage: Stage = SCORE
) -> torch.Tensor | None:
    """Embeddings of the newest `max_rows` texts of the `iterations_back` iterations before this one, from `stage`'s
    files (the completions' scores; self-play: the attacker's prompts' scores)."""
    rows: list[list[float]] = []
    for earlier in range(max(0, iteration - iterations_back), iteration):
        if earlier in run.recorded_iterations(stage):  # a damaged one is an error in read, never skipped
            rows.extend(e for e in run.read(stage, earlier).column("embedding").to_pylist() if e is not None)
    rows = rows[-max_rows:]
    return torch.tensor(rows, dtype=torch.float32) if rows else None


@dataclass
class PolicyTerms:
    """Per completion, under the sampling distribution of the active adapter and of the base (adapters off): the
    logprobs of its tokens on both sides, the mean per-token k3 KL(policy_T || base_T) and the policy's mean
    entropy, all from the trainer's forwards."""

    policy_logprobs: list[list[float]] = field(default_factory=list)
    reference_logprobs: list[list[float]] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)


def policy_terms(
    policy: Policy,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    spans: list[list[tuple[int, int]]] | None = None,
) -> PolicyTerms:
    """Both sides of the KL from the trainer's forwards over the same micro-batches (adapter on, adapter off), and the
    policy's entropy from the first. Never the sampler's logprobs: a cached decode (or another engine) rounds
    differently from a full forward, by ~3e-4 per token in bfloat16 at 4B width, and that difference would be
    charged as KL where policy and base are one model (iteration 0: LoRA's B is 0, both sides are bit-identical,
    the KL exactly 0 in every dtype). Micro-batches of `core/training/batching.py`; the terms in the rows' order.
    `spans`: dialogues, whose terms are over the tokens of those spans of prompt + completion (the policy's turns)."""
    n = len(completion_ids)
    kl, entropy = [math.nan] * n, [math.nan] * n
    policy_lps: list[list[float]] = [[] for _ in range(n)]
    reference_lps: list[list[float]] = [[] for _ in range(n)]
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    for rows in micro_batches(range(n), lengths, micro_batch_size, micro_batch_tokens):
        p, c = [prompt_ids[i] for i in rows], [completion_ids[i] for i in rows]
        s = [spans[i] for i in rows] if spans is not None else None
        pol, ref, ent, mask = policy_entropy_reference_logprobs(policy, p, c, s)
        for i, value in zip(rows, masked_mean(ent, mask, dim=1).tolist(), strict=True):
            entropy[i] = value
        for b, (i, value) in enumerate(zip(rows, sequence_kl(pol, ref, mask).tolist(), strict=True)):
            kl[i] = value
            n_trained = int(mask[b].sum())
            policy_lps[i] = pol[b, :n_trained].tolist()
            reference_lps[i] = ref[b, :n_trained].tolist()
    return PolicyTerms(policy_lps, reference_lps, kl, entropy)


def learner_reward(
    res: RunResources,
    role: str,
    iteration: int,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    harm: list[float | None],
    repetition: list[float],
    novelty: list[float | None],
    refusal: list[bool],
    spans: list[list[tuple[int, int]]] | None = None,
) -> tuple[PolicyTerms, list[float]]:
    """The reward of a learner's rows, assembled here for every learner (the attacked policy, the defender, the
    self-play attacker): the KL and entropy terms from the trainer's forwards under `role`'s adapter as it was when it
    wrote them (after iteration − 1's update), in the micro-batches of `training`, and `Config.reward_weights(role)`."""
    cfg = res.config
    res.ensure_role(role, iteration - 1)
    t = cfg.training
    # both under the sampling distribution (temperature, suppressed ids), both on the trainer's kernels:
    # KL(policy_T || base_T); the rollouts keep the sampler's own logprobs for the update's ratio
    with res.policy.role(role):
        terms = policy_terms(res.policy, prompt_ids, completion_ids, t.micro_batch_size, t.micro_batch_tokens, spans)
    weights = cfg.reward_weights(role)
    reward = [
        composite_reward(RewardTerms(h, rep, k, nov, ref, ent), weights)
        for h, rep, k, nov, ref, ent in zip(harm, repetition, terms.kl, novelty, refusal, terms.entropy, strict=True)
    ]
    return terms, reward


@dataclass(frozen=True)
class ScoredRows:
    """Every column of a scores file but the keys, one entry per row (completions' scores, or self-play's attacker
    prompts'). `harm` is the scorer's score (a classifier's P(label), a judge's P(unsafe)), in every mode;
    `turn_harm` and `turn_rewards`: dialogues' per-turn columns, null when not given."""

    harm: list[float | None]
    scorer: ModelInfo
    categories: list[list[str]]
    refusal: list[bool]
    truncated: list[bool]
    novelty: list[float | None]
    embeddings: list[list[float] | None]
    repetition: list[float]
    terms: PolicyTerms
    reward: list[float]
    turn_harm: list[list[float | None]] | None = None
    turn_rewards: list[list[float]] | None = None

    def table(self, keys: dict[str, list], what: str) -> pa.Table:
        """A table of the SCORES schema with the rows' `keys`; NaN rewards are null."""
        n = len(self.harm)
        return schemas.to_table(
            {
                **{k: keys[k] for k in schemas.KEY_COLUMNS},
                "harm": self.harm,
                "scorer_name": [self.scorer.name] * n,
                "scorer_revision": [self.scorer.revision] * n,
                "scorer_kind": [self.scorer.kind] * n,
                "categories": self.categories,
                "refusal": self.refusal,
                "scorer_truncated": self.truncated,
                "novelty": self.novelty,
                "embedding": self.embeddings,
                "repetition_ratio": self.repetition,
                "policy_logprobs": self.terms.policy_logprobs,
                "reference_logprobs": self.terms.reference_logprobs,
                "kl": self.terms.kl,
                "entropy": self.terms.entropy,
                "reward": [x if math.isfinite(x) else None for x in self.reward],
                "turn_harm": self.turn_harm if self.turn_harm is not None else [None] * n,
                "turn_rewards": (
                    [[x if math.isfinite(x) else None for x in row] for row in self.turn_rewards]
                    if self.turn_rewards is not None
                    else [None] * n
                ),
            },
            schemas.SCORES,
            what,
        )


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


def scores_stats(table: pa.Table) -> ScoreStats:
    """The statistics of a scores table (every part of a sharded stage at once)."""
    columns = table.select(["harm", "repetition_ratio", "novelty", "refusal", "kl", "scorer_truncated"])
    return score_stats(*columns.to_pydict().values())


@task(name="score-shard", task_run_name="score-{iteration}-shard-{shard}", cache_policy=NO_CACHE)
def score_shard(run_dir: str, iteration: int, shard: int, session: str | None = None) -> tuple[str, int]:
    """Score shard `shard`'s part of the rollouts; write its part of the scores table. Novelty compares a completion
    with the others of its shard and with the memory of earlier iterations."""
    res = resources_for(run_dir, session)
    cfg = res.config
    r = cfg.reward
    shards = cfg.runtime.shards
    # dialogues: one row each, whose last answer the judge reads in the light of the whole dialogue; the
    # repetition and KL terms are over every turn the policy wrote (the spans of its last prompt + completion)
    scored_rows = policy_rows(res.run.read_part(SAMPLE, iteration, shard, shards).to_pydict())
    rollouts, spans, own_ids = scored_rows.columns, scored_rows.spans, scored_rows.own_ids
    prompt_ids, completion_ids = rollouts["prompt_token_ids"], rollouts["completion_token_ids"]
    texts = rollouts["completion_text"]
    messages = scored_rows.messages
    scoring = res.scoring
    info = scoring.describe().scorer
    goals = goals_of(res.run, mode_of(cfg).prompts, iteration, rollouts["prompt_id"])
    scored = scoring.score(texts, rollouts["prompt"] if messages is None else [m[:-1] for m in messages], goals)
    if len(scored) != len(texts):
        raise RuntimeError(f"scorer {info.name} returned {len(scored)} scores for {len(texts)} texts")
    harm = [s.harm for s in scored]
    check_unscored(harm, r.max_unscored_share, info)
    dialogue = cfg.dialogue
    per_turn = messages is not None and dialogue.rewards == "per_turn"
    turn_harm = None
    if messages is not None and (per_turn or dialogue.score_each_turn):
        turn_harm = earlier_answers_scored(scoring, messages, harm, goals)
    repetition = repetition_ratios(own_ids, r.repetition_ngram)

    n = len(texts)
    novelty: list[float | None] = [None] * n
    embeddings: list[list[float] | None] = [None] * n
    if r.novelty_weight:
        embedded = scoring.embed(texts)  # [N, D]
        memory = novelty_memory(res.run, iteration, r.novelty_memory_iterations, r.novelty_memory_size)
        novelty = list(novelty_scores(embedded, memory))
        embeddings = embedded.tolist()

    refusal = [bool(s.refusal) for s in scored]
    terms, reward = learner_reward(
        res, DEFAULT_ROLE, iteration, prompt_ids, completion_ids, harm, repetition, novelty, refusal, spans
    )
    turn_reward_lists = None
    if per_turn:
        turn_reward_lists = [
            turn_rewards(answers, terminal, cfg.reward_weights(DEFAULT_ROLE))
            for answers, terminal in zip(turn_harm, reward, strict=True)
        ]
        # the dialogue's reward is its return from the first turn: what the per-turn policy is trained to raise
        reward = [discounted_returns(rewards, dialogue.discount)[0] for rewards in turn_reward_lists]
    categories = [list(s.categories) for s in scored]
    truncated = [bool(s.truncated) for s in scored]
    table = ScoredRows(
        harm=harm,
        scorer=info,
        categories=categories,
        refusal=refusal,
        truncated=truncated,
        novelty=novelty,
        embeddings=embeddings,
        repetition=repetition,
        terms=terms,
        reward=reward,
        turn_harm=turn_harm,
        turn_rewards=turn_reward_lists,
    ).table(rollouts, "scores")
    path = res.run.write(SCORE, iteration, table, res.run.part_path(SCORE, iteration, shard, shards))
    return str(path), table.num_rows


def score_stage(run_dir: str, iteration: int) -> str:
    """Stage 2 in `runtime.shards` shards, one per part of the rollouts (`tasks/common.py: run_sharded_stage`)."""
    res = resources_for(run_dir)
    return run_sharded_stage(res.run, SCORE, iteration, res.config.runtime, score_shard, scores_stats, res.session)
