"""Defense mode (run.mode=defense): a defender trained with GRPO on an attacker's prompts against a safety judge.

The same stages as a red-team iteration, with the attacker's stage first:

    attack -> sample -> score -> advantage -> train_step -> checkpoint

The attacker (an SFT run's adapter, `defense.attacker`, frozen) writes prompts for the iteration's goals; the
defender (the run's adapter on the same base) answers each with G responses; the judge scores each (prompt,
response) pair and the reward is safety − entropy weight × mean token entropy − KL weight × KL(defender ‖ base)
(`reward.*_weight`); advantages, the update and the checkpoint are the red-team stages unchanged.

Self-play (`defense.self_play`): after the defender's update the attacker takes its own GRPO step on its prompts
(attack_score -> attack_advantage -> attack_train_step), rewarded by the judge's verdict on the defender's
responses plus novelty; the checkpoint then holds both adapters and both optimizers.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from redteam_grpo.core.metrics import log_line
from redteam_grpo.flows.attack import owned_run, requested_config, run_iterations
from redteam_grpo.storage.stages import ATTACK_TRAIN_STEP, TRAIN_STEP
from redteam_grpo.tasks.advantage import advantage_stage, attack_advantage_stage
from redteam_grpo.tasks.artifacts import publish_iteration
from redteam_grpo.tasks.attack import attack_stage
from redteam_grpo.tasks.attack_score import attack_score_stage
from redteam_grpo.tasks.checkpoint import checkpoint_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import resources_for
from redteam_grpo.tasks.sample import sample_stage
from redteam_grpo.tasks.score import score_stage
from redteam_grpo.tasks.train_step import attack_train_step_stage, train_step_stage


@flow(name="redteam-defense-iteration", flow_run_name="{run_id}-iteration-{iteration}", log_prints=True)
def defense_iteration(run_dir: str, run_id: str, iteration: int) -> dict[str, float]:
    """One defense iteration; returns its metrics row (core/metrics.py)."""
    attack_stage(run_dir, iteration)
    sample_stage(run_dir, iteration)
    score_stage(run_dir, iteration)
    advantage_stage(run_dir, iteration)
    train_step_stage(run_dir, iteration)
    res = resources_for(run_dir)
    if res.config.defense.self_play:  # the attacker's update, after the defender's, on its own rollouts
        attack_score_stage(run_dir, iteration)
        attack_advantage_stage(run_dir, iteration)
        attack_train_step_stage(run_dir, iteration)
        attacker = res.run.read(ATTACK_TRAIN_STEP, iteration).to_pylist()[0]
        stage_logger().info("attacker " + log_line(iteration, attacker))
    checkpoint_stage(run_dir, iteration)
    metrics = res.run.read(TRAIN_STEP, iteration).to_pylist()[0]
    stage_logger().info(log_line(iteration, metrics))
    if res.config.logging.artifacts:
        publish_iteration(run_dir, iteration, metrics, res.config.logging.artifact_top_k)
    return metrics


@flow(name="redteam-defense", log_prints=True)
def defense_run(
    config: dict[str, Any] | None = None,
    resume: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    on_iteration: Any = None,
    redo: str | None = None,
) -> str:
    """Train a defender against an attacker's prompts (defaults: the embedded defense world, the base writing the
    prompts unless defense.attacker names an SFT run); returns the run directory. Arguments as `attack_run`'s."""
    requested = requested_config(config, config_path, overrides, resume, mode="defense")
    with owned_run(requested, resume, redo, mode="defense") as run:
        return run_iterations(run, defense_iteration, on_iteration)
