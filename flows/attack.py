"""The red-team GRPO run (run.mode=attack): the run every mode shares (flows/runner.py: `run_mode`) with the attack
mode's record (storage/modes.py: ATTACK_MODE), five task stages per iteration.

    for iteration in range(start, iterations):
        sample -> score -> advantage -> train_step -> checkpoint

How this departs from GRPO as published (Shao et al. 2024):
- The KL to the reference is a reward term (reward -= reward.kl_weight * KL, as in the reference red-teaming
  recipe), not a loss term; it is the k3 estimator on the sampling distribution (temperature included) of both
  the policy and the base.
- One optimizer step per sampled batch by default (`training.updates_per_batch`), so the update is
  on-policy: ratio = 1, and clipping (optional) only matters for later steps.
- Advantages are `r - mean(group)` by default; dividing by the group std is an option (off), and rewards
  can be z-scored over the batch first (on, as in the reference system).
- Loss normalisation is per token over the batch by default (DAPO); per sequence is an option.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from redteam_grpo.flows.runner import run_mode
from redteam_grpo.storage.modes import ATTACK_MODE


@flow(name="redteam-run", log_prints=True)
def attack_run(
    config: dict[str, Any] | None = None,
    resume: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    on_iteration: Any = None,
    redo: str | None = None,
) -> str:
    """Run (or resume) a red-team GRPO run; returns the run directory.

    The config is `config`, a nested dict of Config fields, or `config_path`, a YAML file (relative to the
    working directory), with `overrides` such as "run.iterations=3"; defaults for the rest. `resume` is a run
    directory. `on_iteration(metrics)` is called with each iteration's metrics row (the CLI's progress display).
    `redo` (with `resume`): `7` or `7/score` recomputes that part of the run and everything after it.
    """
    return run_mode(ATTACK_MODE, config, resume, config_path, overrides, on_iteration, redo)
