"""One iteration of any mode: the stages its mode's record declares, in order, as one Prefect run of its own.

    attack:            sample -> score -> advantage -> train_step -> checkpoint
    defense:  attack -> sample -> score -> advantage -> train_step -> checkpoint
    self-play: attack -> sample -> score -> advantage -> train_step
                      -> attack_score -> attack_advantage -> attack_train_step -> checkpoint
    sft:               sft_train -> checkpoint

The order lives in `storage/modes.py` (`Mode.stages`), the stage records in `storage/stages.py`; this file binds each
stage to its Prefect task, and nothing here depends on which mode runs.

One step off-policy (training.max_staleness=1, where `Mode.staleness` allows it): iteration i + 1's stages up to the
judge's reading of its rollouts (`Mode.ahead_stages`: sample, judge; defense: attack, sample, judge) run in a thread
beside iteration i's updates and checkpoint, drawing with the adapters after i - 1 from their checkpoints on disk
(tasks/sample.py, tasks/attack.py), so the engine samples and the judge reads while the trainer steps; they are child
task runs of iteration i's run, overlapping its train step in the UI. Iteration i + 1 finds them recorded and goes on
from its score, whose terms need the weights of iteration i's update.

The iteration is a task run (`iteration_task`, the stages its child task runs) where the shards run in the run's
process, and a subflow run (`iteration_flow`) where they run on Ray: a subflow run is what carries a task runner of
its own (prefect-ray's), and it costs ~0.2 s of API calls per iteration against a nested task run's ~0.03 s.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.training.staleness import drawing_version
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.stages import (
    ADVANTAGE,
    ATTACK,
    ATTACK_ADVANTAGE,
    ATTACK_SCORE,
    ATTACK_TRAIN_STEP,
    CHECKPOINT,
    HARDEN,
    JUDGE,
    SAMPLE,
    SCORE,
    SFT_TRAIN,
    TRAIN_STEP,
    Stage,
)
from redteam_grpo.tasks.advantage import advantage_stage, attack_advantage_stage
from redteam_grpo.tasks.artifacts import publish_iteration_later
from redteam_grpo.tasks.attack import attack_stage
from redteam_grpo.tasks.attack_score import attack_score_stage
from redteam_grpo.tasks.checkpoint import checkpoint_stage
from redteam_grpo.tasks.harden import harden_stage
from redteam_grpo.tasks.judge import judge_stage
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
    JUDGE.name: judge_stage,
    SCORE.name: score_stage,
    ADVANTAGE.name: advantage_stage,
    TRAIN_STEP.name: train_step_stage,
    ATTACK_SCORE.name: attack_score_stage,
    ATTACK_ADVANTAGE.name: attack_advantage_stage,
    ATTACK_TRAIN_STEP.name: attack_train_step_stage,
    HARDEN.name: harden_stage,
    SFT_TRAIN.name: sft_train_stage,
    CHECKPOINT.name: checkpoint_stage,
}


class SampleAhead:
    """The stages of an iteration up to the judge's reading of its rollouts (defense: the attacker's prompts, the
    defender's answers, their judgements) in a thread of its own, with the Prefect context of the run that starts it,
    beside the updates of the iteration before; `join` waits for them and raises what they raised."""

    def __init__(self, run_dir: str, iteration: int, stages: tuple[Stage, ...]) -> None:
        self.iteration, self.stages = iteration, stages
        self.error: BaseException | None = None
        context = contextvars.copy_context()  # Prefect's run context: its shards are child task runs of this one
        # a daemon: a stop signal ends the process without waiting for the engine (its parts are written atomically)
        self.thread = threading.Thread(
            target=context.run, args=(self._sample, run_dir), name=f"sample-ahead-{iteration}", daemon=True
        )
        self.thread.start()

    def _sample(self, run_dir: str) -> None:
        try:
            for stage in self.stages:
                STAGE_TASKS[stage.name](run_dir, self.iteration)
        except BaseException as exc:  # raised in the iteration's own thread by `join`
            self.error = exc

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def run_iteration(run_dir: str, run_id: str, iteration: int) -> dict[str, float]:
    """One iteration of the run's mode; returns its metrics row (core/metrics/registry.py; SFT: its epoch's row).
    One step off-policy: the next iteration's sample stage runs beside this one's update (`SampleAhead`)."""
    res = resources_for(run_dir)
    cfg = res.config
    mode = mode_of(cfg)
    log = stage_logger()
    steps, _ = mode.staleness(cfg)
    ahead_stages = mode.ahead_stages(cfg) if steps else ()
    overlapped = steps and iteration + 1 < cfg.run.iterations and not res.run.completed(ahead_stages[-1], iteration + 1)
    ahead = None
    try:
        for stage in mode.stages(cfg):
            if overlapped and ahead is None and stage in mode.update_stages(cfg):
                log.info(
                    "iteration %d: sampling iteration %d with the adapter after iteration %d beside this update",
                    iteration,
                    iteration + 1,
                    drawing_version(iteration + 1, steps),
                )
                ahead = SampleAhead(run_dir, iteration + 1, ahead_stages)
            STAGE_TASKS[stage.name](run_dir, iteration)
    except Exception:
        if ahead is not None:  # what it records stays valid: its draw is fixed by its iteration
            ahead.thread.join()
        raise
    if ahead is not None:
        waited = time.perf_counter()
        ahead.join()
        # the engine's share of the wall time: where this grows, sampling (not the update) bounds the iteration
        log.info(
            "iteration %d: waited %.2f s for iteration %d's rollouts",
            iteration,
            time.perf_counter() - waited,
            iteration + 1,
        )
    for learner in mode.learners(cfg)[1:]:  # self-play: the attacker's row, before the policy's
        log.info(f"{learner.role} " + mode.describe(iteration, res.run.read(learner.update, iteration).to_pylist()[0]))
    metrics = res.run.read(mode.metrics, iteration).to_pylist()[0]
    log.info(mode.describe(iteration, metrics))
    if mode.artifacts and cfg.logging.artifacts:
        publish_iteration_later(run_dir, iteration, metrics, cfg.logging.artifact_top_k, cfg.logging.artifact_examples)
    return metrics


ITERATION_NAME = "redteam-iteration"
RUN_NAME = "{run_id}-iteration-{iteration}"
iteration_flow = flow(name=ITERATION_NAME, flow_run_name=RUN_NAME, log_prints=True)(run_iteration)
iteration_task = task(name=ITERATION_NAME, task_run_name=RUN_NAME, log_prints=True, cache_policy=NO_CACHE)(
    run_iteration
)
