"""Defense stage 0: the attacker writes prompts for the iteration's goals (its adapter on the shared base).

The goals are the iteration's draw of data.source; the attacker's adapter and its system prompt come from the
run's initial checkpoint (`tasks/checkpoint.py: initialize_stage` copies them in), so the run never depends on
the attacker's own run folder after it starts. With sampling.backend=vllm the attacker samples on the engine too,
its adapter loaded beside the defender's on the one served base. The file has the rollouts schema: prompt_id is the
goal's id, prompt the goal, completion the attacker's prompt, with ids and logprobs as drawn.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.data.sources import prompts_for_iteration
from redteam_grpo.core.models.roles import ATTACKER
from redteam_grpo.core.rollouts.dialogue import ATTACKER_SPEAKER
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.storage.stages import ATTACK
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for
from redteam_grpo.tasks.sample import (
    attacker_drawing_version,
    held_version,
    rollouts_stats,
    sample_rollouts,
    vllm_draw,
)


@task(name=ATTACK.name, cache_policy=NO_CACHE)
def attack_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    cfg = res.config

    def compute() -> tuple[pa.Table, Any]:
        goals = prompts_for_iteration(
            res.prompts, iteration, cfg.data.prompts_per_iteration, cfg.run.seed, cfg.data.shuffle
        )
        seed = derive_seed(cfg.run.seed, "attack", iteration)
        d = cfg.attacker_settings
        stale = attacker_drawing_version(res, iteration)
        if stale is not None:  # one step off-policy: from its checkpoint, the weights in memory left to the update
            version, context = stale, contextlib.nullcontext()
            draw = vllm_draw(
                res, stale, seed, ATTACKER, d.prompts_per_goal, d.attacker_max_new_tokens, from_checkpoint=True
            )
        else:
            res.ensure_version(iteration - 1)
            version, context, draw = held_version(res, ATTACKER), res.policy.role(ATTACKER), None
            if cfg.sampling.backend == "vllm":  # the attacker's adapter beside the defender's on the served base
                draw = vllm_draw(res, iteration - 1, seed, ATTACKER, d.prompts_per_goal, d.attacker_max_new_tokens)
        with context:
            table = sample_rollouts(
                res.policy,
                res.run.run_id,
                iteration,
                goals,
                res.attacker_system_prompt,
                cfg.model.max_prompt_tokens,
                d.prompts_per_goal,
                d.attacker_max_new_tokens,
                cfg.sampling.batch_size,
                seed,
                version,
                draw,
                speaker=ATTACKER_SPEAKER,
            )
        return table, rollouts_stats(table, res.policy)

    return run_table_stage(res.run, ATTACK, iteration, compute)
