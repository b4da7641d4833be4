"""Supervised fine-tuning of an attacker (run.mode=sft): one iteration run per epoch, each an `sft_train`
stage and a checkpoint, in a run directory like any other (resume, redo, verification, ownership). Its checkpoints
have the format of GRPO checkpoints, so `defense.attacker` (or a lineage) can start from one."""

from __future__ import annotations

from typing import Any

from prefect import flow

from redteam_grpo.flows.runner import run_mode
from redteam_grpo.storage.modes import SFT_MODE


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
    return run_mode(SFT_MODE, config, resume, config_path, overrides, on_iteration, redo)
