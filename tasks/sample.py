"""Stage 1: sample G completions per prompt from the current policy; record token ids and logprobs."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.chat import format_prompt_ids
from redteam_grpo.core.data import check_prompt_lengths, prompts_for_iteration
from redteam_grpo.core.diagnostics import rollout_stats
from redteam_grpo.core.sampling import sample_completions
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.storage import schemas
from redteam_grpo.storage.stages import SAMPLE
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for


@task(name=SAMPLE.name, cache_policy=NO_CACHE)
def sample_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    cfg = res.config

    def compute():
        res.ensure_version(iteration - 1)
        prompts = prompts_for_iteration(
            res.prompts, iteration, cfg.data.prompts_per_iteration, cfg.run.seed, cfg.data.shuffle
        )
        tokenizer = res.policy.tokenizer
        prompt_ids = [format_prompt_ids(tokenizer, p.text, cfg.model.system_prompt) for p in prompts]
        check_prompt_lengths(prompts, prompt_ids, cfg.model.max_prompt_tokens)
        seed = derive_seed(cfg.run.seed, "sample", iteration)
        completions = sample_completions(
            res.policy,
            prompt_ids,
            cfg.sampling.group_size,
            cfg.sampling.max_new_tokens,
            cfg.sampling.batch_size,
            seed,
        )
        n = len(completions)
        completion_ids = [c.completion_ids for c in completions]
        finish_reasons = [c.finish_reason for c in completions]
        table = schemas.to_table(
            {
                "run_id": [res.run.run_id] * n,
                "iteration": [iteration] * n,
                "prompt_id": [prompts[c.prompt_index].prompt_id for c in completions],
                "sample_idx": [c.sample_idx for c in completions],
                "prompt": [prompts[c.prompt_index].text for c in completions],
                "prompt_token_ids": [prompt_ids[c.prompt_index] for c in completions],
                "completion_token_ids": completion_ids,
                "sampling_logprobs": [c.sample_logprobs for c in completions],
                "completion_text": tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
                "finish_reason": finish_reasons,
                "completion_length": [len(ids) for ids in completion_ids],
                "policy_version": [iteration - 1] * n,
                "sampling_seed": [seed] * n,
                "temperature": [cfg.sampling.temperature] * n,
            },
            schemas.ROLLOUTS,
            "rollouts",
        )
        stats = rollout_stats(completion_ids, finish_reasons, res.policy.end_of_turn_ids, res.policy.turn_header_ids)
        return table, stats

    return run_table_stage(res.run, SAMPLE, iteration, compute)
