"""Scheduled retraining: each run of a lineage continues from the newest checkpoint of the one before it, on
prompts the lineage has not sampled yet, and records its parent (storage/lineage.py). The `scheduled-retraining`
deployment in prefect.yaml runs this flow on a cron schedule with its config from a file."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from redteam_grpo.core.config import load_config
from redteam_grpo.flows.attack import attack_run


@flow(name="redteam-retrain", log_prints=True)
def retrain(lineage: str, config_path: str | None = None, overrides: list[str] | None = None) -> str:
    """Start the next run of `lineage` (its first: from the base model); returns the new run directory.

    `config_path` is a YAML config (relative to the working directory), `overrides` are "key=value" settings.
    """
    config = load_config(Path(config_path) if config_path else None, [*(overrides or []), f"run.lineage={lineage}"])
    return attack_run(config=config.model_dump(mode="json"))
