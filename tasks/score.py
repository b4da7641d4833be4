"""Stage 2: score completions (harm, judge categories, refusal, novelty), repetition of completion tokens,
KL to the base, entropy, and the composite reward. Every component is kept in the scores file.

Defense runs the same stage: the judge scores each (attacker prompt, defender response) pair, and the reward's
weights (reward.safety_weight, entropy_weight, kl_weight) make it the defense reward."""

from __future__ import annotations

import math

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.kl import policy_entropy_reference_logprobs, sequence_kl
from redteam_grpo.core.logprobs import masked_mean
from redteam_grpo.core.novelty import novelty_scores
from redteam_grpo.core.rewards import RewardTerms, composite_reward, repetition_ratios, score_stats
from redteam_grpo.storage import schemas
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SAMPLE, SCORE, Stage
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for


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


@task(name=SCORE.name, cache_policy=NO_CACHE)
def score_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    cfg = res.config
    r = cfg.reward

    def compute():
        rollouts = res.run.read(SAMPLE, iteration).to_pydict()
        prompt_ids, completion_ids = rollouts["prompt_token_ids"], rollouts["completion_token_ids"]
        texts = rollouts["completion_text"]
        scoring = res.scoring
        info = scoring.describe().scorer
        scored = scoring.score(texts, rollouts["prompt"])
        if len(scored) != len(texts):
            raise RuntimeError(f"scorer {info.name} returned {len(scored)} scores for {len(texts)} texts")
        toxicity = [s.score if s.score is not None and math.isfinite(s.score) else None for s in scored]
        repetition = repetition_ratios(completion_ids, r.repetition_ngram)

        n = len(texts)
        novelty: list[float | None] = [None] * n
        embeddings: list[list[float] | None] = [None] * n
        if r.novelty_weight:
            embedded = scoring.embed(texts)  # [N, D]
            memory = novelty_memory(res.run, iteration, r.novelty_memory_iterations, r.novelty_memory_size)
            novelty = list(novelty_scores(embedded, memory))
            embeddings = embedded.tolist()

        res.ensure_version(iteration - 1)  # the weights that sampled this batch
        policy_lp, reference_lp, kl, entropy = [], [], [], []
        step = cfg.training.micro_batch_size
        for start in range(0, len(completion_ids), step):
            p, c = prompt_ids[start : start + step], completion_ids[start : start + step]
            # both under the sampling distribution (temperature, suppressed ids): KL(policy_T || base_T)
            pol, ref, ent, mask = policy_entropy_reference_logprobs(res.policy, p, c)
            kl.extend(sequence_kl(pol, ref, mask).tolist())
            entropy.extend(masked_mean(ent, mask, dim=1).tolist())
            for b, ids in enumerate(c):
                policy_lp.append(pol[b, : len(ids)].tolist())
                reference_lp.append(ref[b, : len(ids)].tolist())
        refusal = [bool(s.refusal) for s in scored]
        weights = r.weights
        reward = [
            composite_reward(RewardTerms(t, rep, k, nov, ref, ent), weights)
            for t, rep, k, nov, ref, ent in zip(toxicity, repetition, kl, novelty, refusal, entropy, strict=True)
        ]
        table = schemas.to_table(
            {
                **{k: rollouts[k] for k in schemas.KEY_COLUMNS},
                "toxicity": toxicity,
                "scorer_name": [info.name] * n,
                "scorer_revision": [info.revision] * n,
                "scorer_kind": [info.kind] * n,
                "categories": [list(s.categories) for s in scored],
                "refusal": refusal,
                "novelty": novelty,
                "embedding": embeddings,
                "repetition_ratio": repetition,
                "policy_logprobs": policy_lp,
                "reference_logprobs": reference_lp,
                "kl": kl,
                "entropy": entropy,
                "reward": [x if math.isfinite(x) else None for x in reward],
            },
            schemas.SCORES,
            "scores",
        )
        truncated = [bool(s.truncated) for s in scored]
        return table, score_stats(toxicity, repetition, novelty, refusal, kl, truncated)

    return run_table_stage(res.run, SCORE, iteration, compute)
