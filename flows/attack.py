"""The red-team GRPO run: a parent flow, one subflow run per iteration, five task stages per iteration.

    for iteration in range(start, iterations):
        sample -> score -> advantage -> train_step -> checkpoint

Each stage reads the previous stage's Parquet file and writes its own (see storage/schemas.py); the run's
manifest records completed stages, so a resumed run continues from the first stage that did not complete.

How this departs from GRPO as published (Shao et al. 2024):
- The KL to the reference is a reward term (reward -= kl_beta * KL, as in the reference system), not a loss
  term; it is computed with the k3 estimator on untempered logits.
- One optimizer step per sampled batch by default (`training.updates_per_batch`), so the update is
  on-policy: ratio = 1, and clipping (optional) only matters for later steps.
- Advantages are `r - mean(group)` by default; dividing by the group std is an option (off), and rewards
  can be z-scored over the batch first (on, as in the reference system).
- Loss normalisation is per token over the batch by default (DAPO); per sequence is an option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from redteam_grpo.core.config import RESUMABLE_CHANGES, Config, ConfigError, load_config, validate_config
from redteam_grpo.storage.lineage import read_lineage, record_in_manifest, start_in_lineage
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.tasks.advantage import advantage_stage
from redteam_grpo.tasks.artifacts import publish_iteration
from redteam_grpo.tasks.checkpoint import checkpoint_stage, initialize_stage
from redteam_grpo.tasks.resources import forget, resources_for, stage_logger
from redteam_grpo.tasks.sample import sample_stage
from redteam_grpo.tasks.score import score_stage
from redteam_grpo.tasks.train_step import train_step_stage

METRICS_LINE = (
    "iteration {iteration}: reward {reward_mean:.3f}  toxicity {toxicity_mean:.3f}  repetition {repetition_mean:.3f}"
    "  KL {kl_mean:.4f}  ratio {ratio_mean:.4f}±{ratio_std:.4f}  sampler-KL {approx_kl:.1e}"
    "  entropy {entropy:.3f}  length {length_mean:.1f}  refusals {refusal_rate:.2f}"
    " (of toxic: {refusal_share_of_toxic:.2f})  novelty {novelty_mean:.3f}"
)


@flow(name="redteam-iteration", flow_run_name="{run_id}-iteration-{iteration}", log_prints=True)
def attack_iteration(run_dir: str, run_id: str, iteration: int) -> dict[str, Any]:
    sample_stage(run_dir, iteration)
    score_stage(run_dir, iteration)
    advantage_stage(run_dir, iteration)
    train_step_stage(run_dir, iteration)
    result = checkpoint_stage(run_dir, iteration)
    stage_logger().info(METRICS_LINE.format(**result["metrics"]))
    logging_cfg = resources_for(run_dir).config.logging
    if logging_cfg.artifacts:
        publish_iteration(run_dir, iteration, result["metrics"], logging_cfg.artifact_top_k)
    return result


def prepare_run(config: Config | None, resume: str | Path | None) -> RunDir:
    """A new run directory for `config`, or the one to resume (its config checked against `config`).

    A run of a lineage records where it starts from once, before its first stage (storage/lineage.py).
    """
    if resume is None:
        run = RunDir.create(config or Config())
    else:
        run = RunDir.open(Path(resume))
        run.check_resume_config(config, RESUMABLE_CHANGES)
    lineage = run.stored_config().run.lineage
    if lineage is not None:
        record = read_lineage(run)
        if record is None:
            start_in_lineage(run, lineage)
        elif run.manifest().get("lineage") is None:
            record_in_manifest(run, record)
    return run


def requested_config(
    config: dict[str, Any] | None, config_path: str | None, overrides: list[str] | None
) -> Config | None:
    """The config asked for: a nested dict, or a YAML file and/or `key=value` overrides (not both ways)."""
    if config is not None and (config_path or overrides):
        raise ConfigError("give either config (a dict) or config_path/overrides, not both")
    if config is not None:
        return validate_config(config)
    if config_path or overrides:
        return load_config(Path(config_path) if config_path else None, list(overrides or []))
    return None


@flow(name="redteam-run", log_prints=True)
def attack_run(
    config: dict[str, Any] | None = None,
    resume: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    on_iteration: Any = None,
) -> str:
    """Run (or resume) a red-team GRPO run; returns the run directory.

    The config is `config`, a nested dict of Config fields, or `config_path`, a YAML file (relative to the
    working directory), with `overrides` such as "run.iterations=3"; defaults for the rest. `resume` is a run
    directory. `on_iteration(result)` is called after each iteration (the CLI's progress display).
    """
    run = prepare_run(requested_config(config, config_path, overrides), resume)
    cfg = run.stored_config()
    log = stage_logger()
    done = run.completed_iterations()
    start = done[-1] + 1 if done else 0
    log.info("run %s: iterations %d..%d in %s", run.run_id, start, cfg.run.iterations - 1, run.root)
    status = run.manifest().get("status")
    if status == "early_stopped" and resume is not None:
        log.info("run %s stopped early before (%s): nothing to do", run.run_id, run.manifest().get("stop_reason"))
        return str(run.root)
    run.set_status("running")
    try:
        initialize_stage(str(run.root))
        for iteration in range(start, cfg.run.iterations):
            result = attack_iteration(str(run.root), run.run_id, iteration)
            if on_iteration is not None:
                on_iteration(result)
            if result["stop_reason"]:
                log.info("early stop after iteration %d: %s", iteration, result["stop_reason"])
                run.set_status("early_stopped", stop_reason=result["stop_reason"])
                return str(run.root)
        run.set_status("completed")
        return str(run.root)
    except BaseException:
        run.set_status("failed")
        raise
    finally:
        forget(run.root)
