"""Stage 2b: the judge stage's columns (harm, judge categories, refusal, novelty), the repetition of the policy's
tokens, KL to the base and entropy from the trainer's forwards, and the composite reward. Every component is kept in
the scores file.

Defense runs the same stage: the judge has scored each (attacker prompt, defender response) pair, and the reward's
weights make it the defense reward: safety − entropy − refusal − KL (reward.safety_weight, entropy_weight,
refusal_weight, kl_weight; a refusal costs less than an unsafe answer and more than a safe one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.models.policy import Policy
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.rollouts.dialogue import policy_rows
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
)
from redteam_grpo.storage import schemas
from redteam_grpo.storage.rundir import DamagedRunError
from redteam_grpo.storage.stages import JUDGE, SAMPLE, SCORE
from redteam_grpo.tasks.common import run_sharded_stage
from redteam_grpo.tasks.resources import RunResources, resources_for


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
    prompts'): what the judge read (`judged`: the judge stage's columns, `schemas.JUDGEMENT_FIELDS`, as its file holds
    them or as `tasks/judge.py: Judgements.columns` gives them) and what needs the policy. `turn_harm` and
    `turn_rewards`: dialogues' per-turn columns, null when not given."""

    judged: dict[str, list]
    repetition: list[float]
    terms: PolicyTerms
    reward: list[float]
    turn_harm: list[list[float | None]] | None = None
    turn_rewards: list[list[float]] | None = None

    def table(self, keys: dict[str, list], what: str) -> pa.Table:
        """A table of the SCORES schema with the rows' `keys`; NaN rewards are null."""
        n = len(self.reward)
        return schemas.to_table(
            {
                **{k: keys[k] for k in schemas.KEY_COLUMNS},
                **self.judged,
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


def judged_rows(judged: pa.Table, rollouts: dict[str, list], iteration: int, shard: int) -> dict[str, list]:
    """The judge stage's part for these rows, its columns, refused unless it holds exactly them, in their order: a
    score, and the reward built on it, is never paired with another row's completion."""
    columns = judged.to_pydict()
    theirs = list(zip(columns["prompt_id"], columns["sample_idx"], strict=True))
    ours = list(zip(rollouts["prompt_id"], rollouts["sample_idx"], strict=True))
    if theirs != ours:
        differ = (k for k, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b)
        first = next(differ, min(len(theirs), len(ours)))
        raise DamagedRunError(
            f"the judgements of shard {shard} of iteration {iteration} are not of its rollouts' rows ({len(theirs)} "
            f"rows against {len(ours)}; first difference at row {first}): they were judged from other rollouts. "
            f"Recompute them with --redo {iteration}/{JUDGE.name}"
        )
    return columns


def scores_stats(table: pa.Table) -> ScoreStats:
    """The statistics of a scores table (every part of a sharded stage at once)."""
    columns = table.select(["harm", "repetition_ratio", "novelty", "refusal", "kl", "scorer_truncated"])
    return score_stats(*columns.to_pydict().values())


@task(name="score-shard", task_run_name="score-{iteration}-shard-{shard}", cache_policy=NO_CACHE)
def score_shard(run_dir: str, iteration: int, shard: int, session: str | None = None) -> tuple[str, int]:
    """Score shard `shard`'s part of the rollouts from its judgements; write its part of the scores table."""
    res = resources_for(run_dir, session)
    cfg = res.config
    r = cfg.reward
    shards = cfg.runtime.shards
    # dialogues: one row each, judged whole; the repetition and KL terms are over every turn the policy wrote (the
    # spans of its last prompt + completion)
    scored_rows = policy_rows(res.run.read_part(SAMPLE, iteration, shard, shards).to_pydict())
    rollouts, spans, own_ids = scored_rows.columns, scored_rows.spans, scored_rows.own_ids
    prompt_ids, completion_ids = rollouts["prompt_token_ids"], rollouts["completion_token_ids"]
    judged = judged_rows(res.run.read_part(JUDGE, iteration, shard, shards), rollouts, iteration, shard)
    harm, novelty, refusal = judged["harm"], judged["novelty"], judged["refusal"]
    dialogue = cfg.dialogue
    per_turn = scored_rows.messages is not None and dialogue.rewards == "per_turn"
    turn_harm = judged["turn_harm"] if scored_rows.messages is not None else None
    repetition = repetition_ratios(own_ids, r.repetition_ngram)
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
    table = ScoredRows(
        judged={f.name: judged[f.name] for f in schemas.JUDGEMENT_FIELDS},
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
