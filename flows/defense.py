"""Defense mode (run.mode=defense): a defender trained with GRPO on an attacker's prompts against a safety judge.

The same stages as a red-team iteration, with the attacker's stage first (storage/modes.py: DEFENSE_MODE):

    attack -> sample -> score -> advantage -> train_step -> checkpoint

The attacker (an SFT run's adapter, `defense.attacker`, frozen) writes prompts for the iteration's goals; the
defender (the run's adapter on the same base) answers each with G responses; the judge scores each (prompt,
response) pair and the reward is safety − entropy weight × mean token entropy − refusal weight × refused − KL
weight × KL(defender ‖ base) (`reward.*_weight`; the refusal term keeps refusing everything from paying best);
advantages, the update and the checkpoint are the red-team stages unchanged.

Self-play (`defense.self_play`): after the defender's update the attacker takes its own GRPO step on its prompts
(attack_score -> attack_advantage -> attack_train_step), rewarded by the judge's verdict on the defender's
responses plus novelty; the checkpoint then holds both adapters and both optimizers.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from redteam_grpo.flows.runner import run_mode
from redteam_grpo.storage.modes import DEFENSE_MODE


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
    return run_mode(DEFENSE_MODE, config, resume, config_path, overrides, on_iteration, redo)
