"""Stage 5: seal the iteration's checkpoint (RNG state, manifest written last), prune old ones, decide on
early stopping. Also writes the initial checkpoint a run starts from."""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.lineage import LineageError, parent_checkpoint_dir, read_lineage
from redteam_grpo.tasks.resources import INIT_VERSION, resources_for, stage_logger


def _checkpoint_info(res, iteration: int) -> dict:
    cfg = res.config
    return {
        "run_id": res.run.run_id,
        "iteration": iteration,
        "base_model": cfg.model.policy,
        "base_revision": cfg.model.revision,
        "lora": {
            "rank": cfg.model.lora_rank,
            "alpha": cfg.model.lora_alpha,
            "targets": cfg.model.lora_target_modules,
        },
        "system_prompt": cfg.model.system_prompt,
    }


# What must match for a parent checkpoint's adapter to be loadable into this run's policy.
_ADAPTER_COMPATIBILITY = ("base_model", "base_revision", "lora")


def parent_adapter(res, ours: dict) -> tuple[Path, str] | None:
    """The adapter file a lineage run starts from and its checkpoint folder, checked against this run's model
    (`ours`: this run's checkpoint info)."""
    record = read_lineage(res.run)
    folder = parent_checkpoint_dir(res.run, record) if record is not None else None
    if folder is None:
        return None
    try:
        parent = checkpoints.read_manifest(folder)
    except checkpoints.CheckpointError as exc:
        raise LineageError(
            f"run {res.run.run_id} continues lineage {record.lineage!r} from {folder}, which is unusable: {exc}. "
            "Restore that checkpoint (the parent run must sit beside this one), or start a new run of the lineage."
        ) from None
    differing = [key for key in _ADAPTER_COMPATIBILITY if parent.get(key) != ours[key]]
    if differing:
        detail = "; ".join(f"{key}: parent {parent.get(key)!r}, this run {ours[key]!r}" for key in differing)
        raise LineageError(
            f"lineage {record.lineage!r}: the parent checkpoint {folder} was trained with a different model "
            f"({detail}). Use the parent's model settings, or start a new lineage (run.lineage)."
        )
    return folder / checkpoints.ADAPTER_FILE, f"{record.parent_run}/checkpoints/{folder.name}"


@task(name="initialize", cache_policy=NO_CACHE)
def initialize_stage(run_dir: str) -> str:
    """The adapter the run starts from as a checkpoint, so every later stage can reload it: the seeded LoRA init,
    or, in a lineage, the parent run's newest adapter (the optimizer starts fresh: a new run, new prompts)."""
    res = resources_for(run_dir)
    folder = res.run.checkpoint_dir(INIT_VERSION)
    try:
        checkpoints.read_manifest(folder)
        return str(folder)
    except checkpoints.CheckpointError:
        pass
    if res.version not in (None, INIT_VERSION):
        raise RuntimeError("the initial checkpoint is missing but the policy has already been trained")
    info = _checkpoint_info(res, INIT_VERSION)
    parent = parent_adapter(res, info)
    if parent is not None:
        adapter_file, info["parent_checkpoint"] = parent
        res.policy.load_adapter(adapter_file)
        stage_logger().info("run %s starts from the adapter of %s", res.run.run_id, info["parent_checkpoint"])
    folder.mkdir(parents=True, exist_ok=True)
    checkpoints.save_adapter(folder / checkpoints.ADAPTER_FILE, res.policy.adapter_state())
    checkpoints.write_manifest(folder, info)
    res.version = INIT_VERSION
    return str(folder)


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint_stage(run_dir: str, iteration: int) -> dict:
    """Returns the iteration's metrics and, if the run should stop early, why."""
    res = resources_for(run_dir)
    run, cfg = res.run, res.config
    metrics = schemas.read_table(run.stage_path(iteration, "train_step"), schemas.TRAIN_METRICS).to_pylist()[0]
    folder = run.checkpoint_dir(iteration)
    if not run.stage_done(iteration, "checkpoint"):
        checkpoints.save_rng(folder / checkpoints.RNG_FILE)
        summary = {k: metrics[k] for k in ("reward_mean", "toxicity_mean", "repetition_mean", "kl_mean")}
        checkpoints.write_manifest(folder, {**_checkpoint_info(res, iteration), "metrics": summary})
        run.mark_stage_done(iteration, "checkpoint", [folder / checkpoints.MANIFEST_FILE])
        if cfg.run.keep_checkpoints:
            done = run.completed_iterations()
            for old in done[: -cfg.run.keep_checkpoints]:
                shutil.rmtree(run.checkpoint_dir(old), ignore_errors=True)
    else:
        stage_logger().info("iteration %d: checkpoint already completed", iteration)
    stop_reason = None
    if cfg.run.early_stop_reward is not None and metrics["reward_mean"] > cfg.run.early_stop_reward:
        stop_reason = f"mean reward {metrics['reward_mean']:.3f} > run.early_stop_reward {cfg.run.early_stop_reward}"
    elif cfg.run.early_stop_repetition is not None and metrics["repetition_mean"] > cfg.run.early_stop_repetition:
        stop_reason = (
            f"mean repetition ratio {metrics['repetition_mean']:.3f} > run.early_stop_repetition "
            f"{cfg.run.early_stop_repetition}"
        )
    return {"metrics": metrics, "stop_reason": stop_reason}
