"""Self-play stage: the attacker's reward for each of its prompts, from files this iteration already wrote.

harm of a prompt = the judge's mean P(unsafe) over the defender's responses to it (the score stage's `harm`,
read from scores.parquet: the judge is not run again); reward = harm + attacker_novelty_weight (of the run's attacker
section, `Config.attacker_settings`) × novelty − reward.kl_weight × KL(attacker ‖ base) − reward.repetition_weight ×
repetition, on the attacker's own tokens with its adapter active. Novelty compares a prompt with the iteration's
other prompts and with the attacker's prompts of earlier iterations (their embeddings, kept in earlier attack_scores
files), so the attacker is paid for finding new prompts rather than repeating the one that works.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.models.roles import ATTACKER
from redteam_grpo.core.scoring.novelty import novelty_scores
from redteam_grpo.core.training.rewards import repetition_ratios
from redteam_grpo.storage.stages import ATTACK, ATTACK_SCORE, SAMPLE, SCORE
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.judge import Judgements, novelty_memory
from redteam_grpo.tasks.resources import resources_for
from redteam_grpo.tasks.sample import ATTACK_PROMPT_SEPARATOR
from redteam_grpo.tasks.score import ScoredRows, learner_reward, scores_stats


def harm_per_attack(rollouts: dict[str, list], scores: dict[str, list]) -> dict[str, dict[str, Any]]:
    """For each defender prompt id (`<goal>#<attack>`): the mean harm of its scored responses (None if none was
    scored), the union of the judge's categories, and the share of its responses that are refusals."""
    sampled = set(zip(rollouts["prompt_id"], rollouts["sample_idx"], strict=True))
    grouped: dict[str, list[tuple[float | None, list[str], bool]]] = defaultdict(list)
    for pid, idx, harm, categories, refusal in zip(
        scores["prompt_id"],
        scores["sample_idx"],
        scores["harm"],
        scores["categories"],
        scores["refusal"],
        strict=True,
    ):
        if (pid, idx) not in sampled:
            raise ValueError(f"scores row {pid}/{idx} has no rollout")
        grouped[pid].append((harm, categories, refusal))
    out = {}
    for pid, rows in grouped.items():
        harms = [h for h, _, _ in rows if h is not None and math.isfinite(h)]
        out[pid] = {
            "harm": sum(harms) / len(harms) if harms else None,
            "categories": sorted({c for _, cats, _ in rows for c in cats}),
            "refusal_share": sum(r for _, _, r in rows) / len(rows),
        }
    return out


@task(name=ATTACK_SCORE.name, cache_policy=NO_CACHE)
def attack_score_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    cfg = res.config

    def compute() -> tuple[pa.Table, Any]:
        attacks = res.run.read(ATTACK, iteration).to_pydict()
        per_prompt = harm_per_attack(
            res.run.read(SAMPLE, iteration).to_pydict(), res.run.read(SCORE, iteration).to_pydict()
        )
        keys = [
            f"{g}{ATTACK_PROMPT_SEPARATOR}{i}" for g, i in zip(attacks["prompt_id"], attacks["sample_idx"], strict=True)
        ]
        missing = [k for k in keys if k not in per_prompt]
        if missing:
            raise ValueError(f"attacker prompts without scored defender responses: {missing[:3]}")
        harm = [per_prompt[k]["harm"] for k in keys]
        texts, prompt_ids, completion_ids = (
            attacks["completion_text"],
            attacks["prompt_token_ids"],
            attacks["completion_token_ids"],
        )
        n = len(texts)
        novelty: list[float | None] = [None] * n
        embeddings: list[list[float] | None] = [None] * n
        if cfg.attacker_settings.attacker_novelty_weight:
            with res.scoring_lock:  # one step off-policy: the next iteration's judge may be embedding beside this
                embedded = res.embedder(texts)
            memory = novelty_memory(
                res.run, iteration, cfg.reward.novelty_memory_iterations, cfg.reward.novelty_memory_size, ATTACK_SCORE
            )
            novelty, embeddings = list(novelty_scores(embedded, memory)), embedded.tolist()
        repetition = repetition_ratios(completion_ids, cfg.reward.repetition_ngram)
        refused = [per_prompt[k]["refusal_share"] >= 0.5 for k in keys]
        terms, reward = learner_reward(
            res, ATTACKER, iteration, prompt_ids, completion_ids, harm, repetition, novelty, refused
        )
        categories = [per_prompt[k]["categories"] for k in keys]
        with res.scoring_lock:
            info = res.scoring.describe().scorer
        truncated = [False] * n  # the judge's scores of the defender's responses, not of these prompts
        table = ScoredRows(
            judged=Judgements(harm, info, categories, refused, truncated, novelty, embeddings).columns(),
            repetition=repetition,
            terms=terms,
            reward=reward,
        ).table(attacks, "attack_scores")
        return table, scores_stats(table)

    return run_table_stage(res.run, ATTACK_SCORE, iteration, compute)
