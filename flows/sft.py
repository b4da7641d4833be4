"""Supervised fine-tuning of an attacker (run.mode=sft): one subflow run per epoch, each an `sft_train` stage and
a checkpoint, in a run directory like any other (resume, redo, verification, ownership). Its checkpoints have the
format of GRPO checkpoints, so `defense.attacker` (or a lineage) can start from one."""

from __future__ import annotations

from typing import Any

from prefect import flow

from redteam_grpo.flows.attack import owned_run, requested_config, run_iterations
from redteam_grpo.storage.stages import SFT_TRAIN
from redteam_grpo.tasks.checkpoint import checkpoint_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import resources_for
from redteam_grpo.tasks.sft import sft_train_stage


@flow(name="redteam-sft-epoch", flow_run_name="{run_id}-epoch-{iteration}", log_prints=True)
def sft_epoch_flow(run_dir: str, run_id: str, iteration: int) -> dict[str, float]:
    """One epoch; returns its row of sft_metrics.parquet."""
    sft_train_stage(run_dir, iteration)
    checkpoint_stage(run_dir, iteration)
    row = resources_for(run_dir).run.read(SFT_TRAIN, iteration).to_pylist()[0]
    stage_logger().info(
        "epoch %d: train loss %.4f  eval loss %.4f  (%d steps, %.1f s)",
        iteration,
        row["train_loss"],
        row["eval_loss"],
        row["steps"],
        row["seconds"],
    )
    return row


@flow(name="redteam-sft", log_prints=True)
def sft_run(
    config: dict[str, Any] | None = None,
    resume: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    on_iteration: Any = None,
    redo: str | None = None,
) -> str:
    """Fine-tune an attacker on (goal → adversarial prompt) pairs (defaults: the bundled pairs, the embedded defense
    base); returns the run directory, whose newest checkpoint is the attacker. Arguments as `attack_run`'s."""
    requested = requested_config(config, config_path, overrides, resume, mode="sft")
    with owned_run(requested, resume, redo, mode="sft") as run:
        return run_iterations(run, sft_epoch_flow, on_iteration)
