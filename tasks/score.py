"""Stage 2: score completions (toxicity), repetition of completion tokens, KL to the base, composite reward."""

from __future__ import annotations

import math

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.kl import sequence_kl
from redteam_grpo.core.policy import untempered_logprobs
from redteam_grpo.core.rewards import composite_reward, repetition_ratios
from redteam_grpo.storage import schemas
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for


@task(name="score", cache_policy=NO_CACHE)
def score_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    cfg = res.config

    def compute():
        rollouts = schemas.read_table(res.run.stage_path(iteration, "sample"), schemas.ROLLOUTS).to_pydict()
        prompt_ids, completion_ids = rollouts["prompt_token_ids"], rollouts["completion_token_ids"]
        scorer = res.scorer
        toxicity = scorer(rollouts["completion_text"], rollouts["prompt"])
        if len(toxicity) != len(completion_ids):
            raise RuntimeError(f"scorer {scorer.name} returned {len(toxicity)} scores for {len(completion_ids)} texts")
        toxicity = [t if t is not None and math.isfinite(t) else None for t in toxicity]
        repetition = repetition_ratios(completion_ids, cfg.reward.repetition_ngram)

        res.ensure_version(iteration - 1)  # the weights that sampled this batch
        policy_lp, reference_lp, kl = [], [], []
        step = cfg.training.micro_batch_size
        for start in range(0, len(completion_ids), step):
            p, c = prompt_ids[start : start + step], completion_ids[start : start + step]
            pol, mask = untempered_logprobs(res.policy, p, c, reference=False)
            ref, _ = untempered_logprobs(res.policy, p, c, reference=True)
            kl.extend(sequence_kl(pol, ref, mask).tolist())
            for b, ids in enumerate(c):
                policy_lp.append(pol[b, : len(ids)].tolist())
                reference_lp.append(ref[b, : len(ids)].tolist())
        r = cfg.reward
        reward = [
            composite_reward(t, rep, k, r.toxicity_weight, r.repetition_penalty, cfg.training.kl_beta)
            for t, rep, k in zip(toxicity, repetition, kl, strict=True)
        ]
        n = len(completion_ids)
        return schemas.to_table(
            {
                **{k: rollouts[k] for k in schemas.KEY_COLUMNS},
                "toxicity": toxicity,
                "scorer_name": [scorer.name] * n,
                "scorer_revision": [scorer.revision] * n,
                "repetition_ratio": repetition,
                "policy_logprobs": policy_lp,
                "reference_logprobs": reference_lp,
                "kl": kl,
                "reward": [x if math.isfinite(x) else None for x in reward],
            },
            schemas.SCORES,
            "scores",
        )

    return run_table_stage(res.run, iteration, "score", compute)
