"""One iteration of any mode: the stages its mode's record declares, in order, as one Prefect run of its own.

    attack:            sample -> score -> advantage -> train_step -> checkpoint
    defense:  attack -> sample -> score -> advantage -> train_step -> checkpoint
    self-play: attack -> sample -> score -> advantage -> train_step
                      -> attack_score -> attack_advantage -> attack_train_step -> checkpoint
    sft:               sft_train -> checkpoint

The order lives in `storage/modes.py` (`Mode.stages`), the stage records in `storage/stages.py`; this file binds each
stage to its Prefect task, and nothing here depends on which mode runs.

The iteration is a task run (`iteration_task`, the stages its child task runs) where the shards run in the run's
process, and a subflow run (`iteration_flow`) where they run on Ray: a subflow run is what carries a task runner of
its own (prefect-ray's), and it costs ~0.2 s of API calls per iteration against a nested task run's ~0.03 s.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.stages import (
    ADVANTAGE,
    ATTACK,
    ATTACK_ADVANTAGE,
    ATTACK_SCORE,
    ATTACK_TRAIN_STEP,
    CHECKPOINT,
    SAMPLE,
    SCORE,
    SFT_TRAIN,
    TRAIN_STEP,
)
from redteam_grpo.tasks.advantage import advantage_stage, attack_advantage_stage
from redteam_grpo.tasks.artifacts import publish_iteration
from redteam_grpo.tasks.attack import attack_stage
from redteam_grpo.tasks.attack_score import attack_score_stage
from redteam_grpo.tasks.checkpoint import checkpoint_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import resources_for
from redteam_grpo.tasks.sample import sample_stage
from redteam_grpo.tasks.score import score_stage
from redteam_grpo.tasks.sft import sft_train_stage
from redteam_grpo.tasks.train_step import attack_train_step_stage, train_step_stage

# What runs each stage, by the stage's name; each is called as run(run_dir, iteration). Sample and score are
# functions that submit one task per shard; the others are one task each.
STAGE_TASKS: dict[str, Callable[[str, int], str]] = {
    ATTACK.name: attack_stage,
    SAMPLE.name: sample_stage,
    SCORE.name: score_stage,
    ADVANTAGE.name: advantage_stage,
    TRAIN_STEP.name: train_step_stage,
    ATTACK_SCORE.name: attack_score_stage,
    ATTACK_ADVANTAGE.name: attack_advantage_stage,
    ATTACK_TRAIN_STEP.name: attack_train_step_stage,
    SFT_TRAIN.name: sft_train_stage,
    CHECKPOINT.name: checkpoint_stage,
}


def run_iteration(run_dir: str, run_id: str, iteration: int) -> dict[str, float]:
    """One iteration of the run's mode; returns its metrics row (core/metrics/registry.py; SFT: its epoch's row)."""
    res = resources_for(run_dir)
    cfg = res.config
    mode = mode_of(cfg)
    for stage in mode.stages(cfg):
        STAGE_TASKS[stage.name](run_dir, iteration)
    log = stage_logger()
    for learner in mode.learners(cfg)[1:]:  # self-play: the attacker's row, before the policy's
        log.info(f"{learner.role} " + mode.describe(iteration, res.run.read(learner.update, iteration).to_pylist()[0]))
    metrics = res.run.read(mode.metrics, iteration).to_pylist()[0]
    log.info(mode.describe(iteration, metrics))
    if mode.artifacts and cfg.logging.artifacts:
        publish_iteration(run_dir, iteration, metrics, cfg.logging.artifact_top_k, cfg.logging.artifact_examples)
    return metrics


ITERATION_NAME = "redteam-iteration"
RUN_NAME = "{run_id}-iteration-{iteration}"
iteration_flow = flow(name=ITERATION_NAME, flow_run_name=RUN_NAME, log_prints=True)(run_iteration)
iteration_task = task(name=ITERATION_NAME, task_run_name=RUN_NAME, log_prints=True, cache_policy=NO_CACHE)(
    run_iteration
)
