"""Stage 4: one GRPO update on the iteration's rollouts and advantages; writes the updated adapter and
optimizer state (into the iteration's checkpoint folder) and the iteration's metrics row, assembled from the
statistics each earlier stage recorded with its file (core/metrics/registry.py)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.metrics.registry import iteration_metrics
from redteam_grpo.core.rollouts.diagnostics import health_warnings
from redteam_grpo.core.rollouts.dialogue import policy_rows
from redteam_grpo.core.tokens.logprobs import SamplingDistribution
from redteam_grpo.core.training.staleness import StaleRolloutsError, check_staleness, staleness_of
from redteam_grpo.core.training.train import NonFiniteUpdateError, TrainBatch, UpdateStats, policy_gradient_step
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ATTACK_TRAIN_STEP, ATTACKER_LEARNER, POLICY, TRAIN_STEP, Learner, Stage
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import RunResources, resources_for


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


def recorded_stats(run: RunDir, stage: Stage, iteration: int) -> dict[str, float]:
    return run.verify(stage, iteration, weights=False)["stats"]


@task(name=TRAIN_STEP.name, cache_policy=NO_CACHE)
def train_step_stage(run_dir: str, iteration: int) -> str:
    return update_stage(run_dir, iteration, POLICY)


@task(name=ATTACK_TRAIN_STEP.name, cache_policy=NO_CACHE)
def attack_train_step_stage(run_dir: str, iteration: int) -> str:
    """Self-play: the attacker's update, on its own rollouts (the attacks file) with its adapter active."""
    return update_stage(run_dir, iteration, ATTACKER_LEARNER)


def train_batch(
    run: RunDir,
    learner: Learner,
    iteration: int,
    max_new_tokens: int,
    sampler: str,
    suppressed_ids: tuple[int, ...] = (),
    max_staleness: int = 0,
    starts_from: int | None = None,
) -> TrainBatch:
    """The learner's rollouts of `iteration` joined with their advantages. Dialogues (rows of later turns): one row per
    dialogue, its last turn's prompt and completion with the spans of the policy's own turns
    (core/rollouts/dialogue.py). The distribution drawn from is the temperature the rollouts recorded, with the
    policy's `suppressed_ids`: the first-update bound is the sampler's, whatever the trainer replays. Every row the
    learner drew must be drawn by weights at most `max_staleness` updates older than those its update starts from
    (0: those very weights; core/training/staleness.py), all rows by one version, whose staleness the batch carries.
    `starts_from`: the version the update starts from where it is not iteration - 1's (`Mode.starting_version`: a
    role restarted from its initial checkpoint)."""
    table = run.read(learner.rollouts, iteration).to_pydict()
    own_rows = [v for v, s in zip(table["policy_version"], table["speaker"], strict=True) if s == learner.speaker]
    redo = f"redteam-grpo {run.command} --resume {run.root} --redo {iteration}"
    try:
        check_staleness(own_rows, iteration, max_staleness, learner.rollouts.name, starts_from)
    except StaleRolloutsError as exc:
        raise StaleRolloutsError(f"{exc}: {redo}") from None
    versions = sorted(set(own_rows))
    if len(versions) > 1:  # one batch, one behaviour policy: the staleness and the check's skip are the batch's
        raise StaleRolloutsError(
            f"{learner.rollouts.name} of iteration {iteration} holds rows drawn by adapter versions {versions}: a "
            f"batch is drawn by one version. Sample the iteration again: {redo}"
        )
    trained = policy_rows(table)
    rollouts = trained.columns
    advantages = run.read(learner.advantages, iteration).to_pydict()
    rows = join_on_keys(rollouts, advantages, "rollouts x advantages")
    temperatures = sorted(set(rollouts["temperature"]))
    if len(temperatures) > 1:
        raise ValueError(
            f"{learner.rollouts.name} of iteration {iteration} was drawn at several temperatures {temperatures}: one "
            "batch is drawn from one distribution; sample the iteration again (delete its files and resume)"
        )
    sampled_with = SamplingDistribution(float(temperatures[0]), suppressed_ids) if temperatures else None
    return TrainBatch(
        prompt_ids=rollouts["prompt_token_ids"],
        completion_ids=rollouts["completion_token_ids"],
        sample_logprobs=trained.logprobs,
        advantages=[advantages["advantage"][i] for i in rows],
        group_ids=rollouts["prompt_id"],
        max_new_tokens=max_new_tokens,
        spans=trained.spans,
        sampler=sampler,
        sampled_with=sampled_with,
        staleness=staleness_of(versions[0], iteration, starts_from) if versions else 0,
        turn_advantages=(
            [advantages["turn_advantages"][i] for i in rows]
            if any(a is not None for a in advantages["turn_advantages"])
            else None
        ),
    )


def update_in_memory(res: RunResources, iteration: int, learner: Learner, data_parallel=None) -> UpdateStats:
    """One update of the learner's adapter (and optimizer) in memory, from the weights after iteration - 1."""
    cfg = res.config
    batch = train_batch(
        res.run,
        learner,
        iteration,
        learner.max_new_tokens(cfg),
        cfg.sampling.backend,
        res.policy.distribution.suppressed_ids,
        mode_of(cfg).staleness(cfg)[0],
        mode_of(cfg).starting_version(cfg, learner.role, iteration),
    )
    res.ensure_role(learner.role, iteration - 1)  # self-play: the defender may already hold this iteration's update
    with res.policy.role(learner.role):
        try:
            return policy_gradient_step(res.policy, res.optimizer_for(learner.role), batch, cfg.training, data_parallel)
        except NonFiniteUpdateError:
            res.holds(learner.role, None)  # the step changed the weights in memory: the next stage reloads them
            raise


def save_update(res: RunResources, learner: Learner, weights: list[Path]) -> None:
    checkpoints.save_adapter(weights[0], res.policy.adapter_state(learner.role))
    checkpoints.save_optimizer(weights[1], res.optimizer_for(learner.role))


def update_stage(run_dir: str, iteration: int, learner: Learner) -> str:
    """One GRPO update of `learner`'s adapter from the weights of iteration - 1. The role's adapter is the only one
    active (and trainable) in every forward; its ratio is checked against the logprobs recorded when its own rollouts
    were sampled, so an update that saw another role's or another version's weights is refused.
    training.launcher=torchrun: the update runs data-parallel in `nproc` processes (`tasks/distributed_update.py`),
    which write the weights; the ones in this process's memory are then stale and reloaded when next needed."""
    res = resources_for(run_dir)
    run, cfg = res.run, res.config
    folder = run.checkpoint_dir(iteration)
    weights = [folder / learner.adapter_file, folder / learner.optimizer_file]

    def compute():
        started = time.perf_counter()
        if cfg.training.launcher == "torchrun":
            from redteam_grpo.tasks.distributed_update import launch

            update = launch(run, iteration, learner, cfg.training.nproc)
            version = None  # what this process holds is not the new weights
        else:
            update = update_in_memory(res, iteration, learner)
            save_update(res, learner, weights)
            version = iteration
        res.holds(learner.role, version)

        # Each earlier stage recorded the statistics it computed; none is recomputed here.
        metrics = iteration_metrics(
            *(
                recorded_stats(run, stage, iteration)
                for stage in (learner.rollouts, learner.scores, learner.advantages)
            ),
            update,
            {"update_seconds": time.perf_counter() - started},
        )
        for warning in health_warnings(metrics, iteration):
            stage_logger().warning(warning)
        table = schemas.to_table(
            {"run_id": [run.run_id], "iteration": [iteration], **{k: [v] for k, v in metrics.items()}},
            schemas.TRAIN_METRICS,
            learner.update.label,
        )
        return table, {}

    return run_table_stage(run, learner.update, iteration, compute, also_written=weights)
