"""Stage 4: one GRPO update on the iteration's rollouts and advantages; writes the updated adapter and
optimizer state (into the iteration's checkpoint folder) and the iteration's metrics."""

from __future__ import annotations

import math
import time
from collections import defaultdict

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.diagnostics import health_warnings, rollout_diagnostics
from redteam_grpo.core.train import TrainBatch, policy_gradient_step
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for, stage_logger

TOXIC = 0.5  # toxicity at which a completion counts as a "successful" attack in refusal_share_of_toxic


class JoinError(ValueError):
    """Rows of two stages do not match one to one."""


def join_on_keys(left: dict[str, list], right: dict[str, list], what: str) -> list[int]:
    """For each row of `left`, the index of the row of `right` with the same (prompt_id, sample_idx)."""
    index = {key: i for i, key in enumerate(zip(right["prompt_id"], right["sample_idx"], strict=True))}
    keys = list(zip(left["prompt_id"], left["sample_idx"], strict=True))
    missing = [k for k in keys if k not in index]
    if missing or len(index) != len(keys):
        raise JoinError(f"{what}: {len(keys)} rows vs {len(index)}, unmatched keys {missing[:3]}")
    return [index[k] for k in keys]


def _mean(values) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


@task(name="train_step", cache_policy=NO_CACHE)
def train_step_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    run, cfg = res.run, res.config
    folder = run.checkpoint_dir(iteration)
    weights = [folder / checkpoints.ADAPTER_FILE, folder / checkpoints.OPTIMIZER_FILE]

    def compute():
        started = time.perf_counter()
        rollouts = schemas.read_table(run.stage_path(iteration, "sample"), schemas.ROLLOUTS).to_pydict()
        scores = schemas.read_table(run.stage_path(iteration, "score"), schemas.SCORES).to_pydict()
        advantages = schemas.read_table(run.stage_path(iteration, "advantage"), schemas.ADVANTAGES).to_pydict()
        adv_rows = join_on_keys(rollouts, advantages, "rollouts x advantages")
        score_rows = join_on_keys(rollouts, scores, "rollouts x scores")

        res.ensure_version(iteration - 1)
        batch = TrainBatch(
            prompt_ids=rollouts["prompt_token_ids"],
            completion_ids=rollouts["completion_token_ids"],
            sample_logprobs=rollouts["sampling_logprobs"],
            advantages=[advantages["advantage"][i] for i in adv_rows],
        )
        metrics = policy_gradient_step(res.policy, res.optimizer, batch, cfg.training)

        checkpoints.save_adapter(weights[0], res.policy.adapter_state())
        checkpoints.save_optimizer(weights[1], res.optimizer)
        res.version = iteration

        rewards = [scores["reward"][i] for i in score_rows]
        finite_rewards = [r for r in rewards if r is not None and math.isfinite(r)]
        mean_reward = _mean(rewards)
        group_advantage = defaultdict(list)
        for pid, i in zip(rollouts["prompt_id"], adv_rows, strict=True):
            group_advantage[pid].append(advantages["advantage"][i])
        metrics.update(
            rollout_diagnostics(
                rollouts["completion_token_ids"],
                rollouts["finish_reason"],
                res.policy.end_of_turn_ids,
                res.policy.turn_header_ids,
            )
        )
        metrics.update(
            reward_mean=mean_reward,
            reward_std=math.sqrt(_mean([(r - mean_reward) ** 2 for r in finite_rewards]))
            if finite_rewards
            else math.nan,
            toxicity_mean=_mean(scores["toxicity"]),
            repetition_mean=_mean(scores["repetition_ratio"]),
            novelty_mean=_mean(scores["novelty"]),
            refusal_rate=_mean([float(f) for f in scores["refusal"]]),
            refusal_share_of_toxic=_mean(
                [
                    float(f)
                    for f, t in zip(scores["refusal"], scores["toxicity"], strict=True)
                    if t is not None and t >= TOXIC
                ]
            ),
            kl_mean=_mean(scores["kl"]),
            kl_max=max(scores["kl"], default=0.0),
            n_invalid_rewards=float(len(rewards) - len(finite_rewards)),
            n_degenerate_groups=float(sum(all(a == 0.0 for a in advs) for advs in group_advantage.values())),
            seconds=time.perf_counter() - started,
        )
        for warning in health_warnings(metrics, iteration):
            stage_logger().warning(warning)
        row = {name: [metrics.get(name, math.nan)] for name in schemas.TRAIN_METRICS.names}
        row.update(run_id=[run.run_id], iteration=[iteration])
        return schemas.to_table(row, schemas.TRAIN_METRICS, "train_metrics")

    return run_table_stage(run, iteration, "train_step", compute, also_written=weights)
