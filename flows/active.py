"""Active Attacks (run.mode=active; Yun et al. 2025, arXiv 2509.21947): an attacker trained by GRPO against a victim
that is safety-tuned on the attacks found so far at the end of every round, the attacker restarted each round.

The self-play attacker's stages against the victim, and the victim's hardening (storage/modes.py: ACTIVE_MODE):

    attack -> sample -> score -> attack_score -> attack_advantage -> attack_train_step -> harden -> checkpoint

The attacker (an SFT run's adapter, `active.attacker`) writes prompts for the iteration's goals; the victim (the
run's adapter on the same base, zero at first: the base itself) answers each with G responses; the judge scores them,
and the attacker is rewarded by their mean P(unsafe) plus novelty, minus KL and repetition. At the last iteration of
each round (`active.harden_every`) the harden stage tunes the victim by LoRA SFT on every attacker prompt found so far
whose harm reached `active.harm_threshold`, paired with refusals (`active.refusals`); the next iteration starts the
attacker over from its initial checkpoint (`active.reset_attacker`). Each checkpoint holds both adapters: the round's
attacker as trained, and the victim as the next iteration answers with it.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from redteam_grpo.flows.runner import run_mode
from redteam_grpo.storage.modes import ACTIVE_MODE


@flow(name="redteam-active", log_prints=True)
def active_run(
    config: dict[str, Any] | None = None,
    resume: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    on_iteration: Any = None,
    redo: str | None = None,
) -> str:
    """Train an attacker against a victim hardened on its attacks every active.harden_every iterations (defaults: the
    embedded defense world, the base writing the prompts unless active.attacker names an SFT run); returns the run
    directory. Arguments as `attack_run`'s."""
    return run_mode(ACTIVE_MODE, config, resume, config_path, overrides, on_iteration, redo)
