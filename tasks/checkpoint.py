"""Stage 5: seal the iteration's checkpoint (its manifest, written last) and prune old ones. Also writes
the initial checkpoint a run starts from."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE
from redteam_grpo.storage import checkpoints, interrupts
from redteam_grpo.storage.lineage import LineageError, parent_checkpoint_dir, read_lineage
from redteam_grpo.storage.location import remove_tree
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import INIT_VERSION, RUN_RECORD
from redteam_grpo.storage.stages import CHECKPOINT
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import resources_for


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
        "quantization": cfg.model.quantization,
    }


# What must match for a parent checkpoint's adapter to be loadable into this run's policy.
_ADAPTER_COMPATIBILITY = ("base_model", "base_revision", "lora")


def model_differences(other: dict, ours: dict, whose: str) -> str:
    """What makes another checkpoint's adapter unloadable into this run's policy ('' when nothing): its base
    model, revision or LoRA shape, each with `whose` value and this run's."""
    differing = [key for key in _ADAPTER_COMPATIBILITY if other.get(key) != ours[key]]
    return "; ".join(f"{key}: {whose} {other.get(key)!r}, this run {ours[key]!r}" for key in differing)


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
    detail = model_differences(parent, ours, "parent")
    if detail:
        raise LineageError(
            f"lineage {record.lineage!r}: the parent checkpoint {folder} was trained with a different model "
            f"({detail}). Use the parent's model settings, or start a new lineage (run.lineage)."
        )
    return folder / checkpoints.ADAPTER_FILE, f"{record.parent_run}/checkpoints/{folder.name}"


def attacker_checkpoint(cfg) -> tuple[Path, dict] | None:
    """The checkpoint folder of the attacker the run's mode names (its attacker section's `attacker`: defense.attacker)
    and its manifest (None: the base writes the prompts)."""
    source = cfg.attacker_settings.attacker
    if source is None:
        return None
    try:
        folder = checkpoints.resolve_adapter_source(source)
        return folder, checkpoints.read_manifest(folder)
    except checkpoints.CheckpointError as exc:
        raise AttackerError(f"{cfg.attacker_section}.attacker {source}: {exc}") from None


def attacker_adapter(res) -> tuple[Path | None, dict]:
    """The attacker's adapter file (None: the base writes the prompts) and what the run records of it,
    checked against this run's model like a lineage parent."""
    cfg = res.config
    found = attacker_checkpoint(cfg)
    if found is None:
        return None, {"source": None, "system_prompt": cfg.attacker_settings.attacker_system_prompt}
    folder, source = found
    detail = model_differences(source, _checkpoint_info(res, INIT_VERSION), "attacker")
    if detail:
        raise AttackerError(
            f"{cfg.attacker_section}.attacker {folder} was trained on another base or LoRA shape ({detail}): attacker "
            "and defender share one base model, so train the attacker with this run's model settings"
        )
    info = {"source": str(folder.resolve()), "run_id": source.get("run_id"), "system_prompt": source["system_prompt"]}
    return folder / checkpoints.ADAPTER_FILE, info


def attacker_system_prompt(cfg) -> str:
    """The system prompt the attacker formats goals with: its checkpoint's (as SFT trained it), else the config's."""
    found = attacker_checkpoint(cfg)
    return cfg.attacker_settings.attacker_system_prompt if found is None else found[1]["system_prompt"]


class AttackerError(RuntimeError):
    """The attacker named by the run's attacker section (defense.attacker) cannot be used; the message says why and
    what to do."""


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
    if res.roles[DEFAULT_ROLE].version not in (None, INIT_VERSION):
        raise RuntimeError("the initial checkpoint is missing but the policy has already been trained")
    info = _checkpoint_info(res, INIT_VERSION)
    parent = parent_adapter(res, info)
    if parent is not None:
        adapter_file, info["parent_checkpoint"] = parent
        res.policy.load_adapter(adapter_file)
        stage_logger().info("run %s starts from the adapter of %s", res.run.run_id, info["parent_checkpoint"])
    folder.mkdir(parents=True, exist_ok=True)
    checkpoints.save_adapter(folder / checkpoints.ADAPTER_FILE, res.policy.adapter_state())
    if ATTACKER in mode_of(res.config).roles:
        attacker_file, info["attacker"] = attacker_adapter(res)
        if attacker_file is not None:
            res.policy.load_adapter(attacker_file, ATTACKER)
        # what is saved here is what every stage loads (`RunResources.ensure_role`, with its optimizer)
        checkpoints.save_adapter(folder / checkpoints.ATTACKER_FILE, res.policy.adapter_state(ATTACKER))
    checkpoints.write_manifest(folder, info)
    res.holds(DEFAULT_ROLE, INIT_VERSION)
    return str(folder)


@task(name=CHECKPOINT.name, cache_policy=NO_CACHE)
def checkpoint_stage(run_dir: str, iteration: int) -> str:
    """Seal the checkpoint of `iteration` (its manifest, written last, over the weights the update stages recorded)
    and prune old ones. No RNG state is kept: every random draw of a stage comes from a generator seeded from
    (run.seed, iteration, stage), so a resumed stage draws what it would have drawn (core/seeds.py)."""
    res = resources_for(run_dir)
    run, cfg = res.run, res.config
    folder = run.checkpoint_dir(iteration)
    if run.completed(CHECKPOINT, iteration):
        stage_logger().info("iteration %d: checkpoint already completed", iteration)
        return str(folder)
    mode = mode_of(cfg)
    metrics = run.read(mode.metrics, iteration).to_pylist()[0]
    for stage in mode.update_stages(cfg):
        run.verify(stage, iteration)  # seal exactly the weights the update stages recorded
    summary = {k: metrics[k] for k in mode.summary}
    with interrupts.recording():  # sealed exactly when recorded
        # this iteration's records and the run's identity, so a damaged manifest or records.json is rebuilt from here
        record = {RUN_RECORD: run.record_for_checkpoint(iteration)}
        checkpoints.write_manifest(folder, {**_checkpoint_info(res, iteration), "metrics": summary, **record})
        run.record_done(CHECKPOINT, iteration, [folder / checkpoints.MANIFEST_FILE])
    if cfg.run.keep_checkpoints:
        for old in run.completed_iterations()[: -cfg.run.keep_checkpoints]:
            if not mode.keeps(cfg, old):  # what the mode's evaluation reads stays
                remove_tree(run.checkpoint_dir(old))
    return str(folder)
