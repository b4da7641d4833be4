"""Scheduled retraining: each run of a lineage continues from the newest checkpoint of the one before it, on
prompts the lineage has not sampled yet, and records its parent (storage/lineage.py). The `scheduled-retraining`
deployment in prefect.yaml runs this flow on a cron schedule with its config from a file."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from redteam_grpo.core.config import load_config, validate_config
from redteam_grpo.flows.attack import attack_run
from redteam_grpo.flows.deployment_guard import check_run_request, from_a_deployment
from redteam_grpo.storage.rundir import RunDir


def run_id_for(name: str, flow_run_id: str | None, scheduled: object) -> str | None:
    """One run folder per flow run: a retried flow run (same id) resumes its folder instead of starting a new
    run, which would skip the prompts the crashed one drew without ever training on them."""
    if not flow_run_id:
        return None
    stamp = scheduled.strftime("%Y%m%d-%H%M%S") if hasattr(scheduled, "strftime") else "unscheduled"
    return f"{name}-{stamp}-{flow_run_id[:8]}"


@flow(name="redteam-retrain", log_prints=True)
def retrain(lineage: str, config_path: str | None = None, overrides: list[str] | None = None) -> str:
    """Start the next run of `lineage` (its first: from the base model); returns the new run directory.

    `config_path` is a YAML config (relative to the working directory), `overrides` are "key=value" settings.
    """
    if from_a_deployment():  # the scheduled deployment's caller asks for less than the command line
        check_run_request(None, config_path, overrides, None)
    raw = load_config(Path(config_path) if config_path else None, list(overrides or [])).model_dump(mode="json")
    raw["run"]["lineage"] = lineage  # as given: through a `key=value` override "null" or "2024" would be parsed
    if raw["run"]["run_id"] is None:
        raw["run"]["run_id"] = run_id_for(raw["run"]["name"], flow_run.id, flow_run.scheduled_start_time)
    config = validate_config(raw)
    folder = RunDir.root_for(config) if config.run.run_id else None
    # A folder is a run once its manifest exists; one without (a creation cut short) is created again.
    if folder is not None and (folder / "manifest.json").is_file():
        return attack_run(config=raw, resume=str(folder))
    return attack_run(config=raw)
