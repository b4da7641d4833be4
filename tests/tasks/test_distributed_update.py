"""training.launcher=torchrun: the train step data-parallel over 2 CPU processes (gloo) writes the update the
single-process train step writes on the same batch, to float tolerance, and the same metrics."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from redteam_grpo.core.config import load_config
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.training.train import RatioCheckError
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import TRAIN_STEP
from redteam_grpo.tasks import resources
from redteam_grpo.tasks.advantage import advantage_stage
from redteam_grpo.tasks.checkpoint import checkpoint_stage, initialize_stage
from redteam_grpo.tasks.judge import judge_stage
from redteam_grpo.tasks.sample import sample_stage
from redteam_grpo.tasks.score import score_stage
from redteam_grpo.tasks.train_step import train_step_stage
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")

# 12 rows in micro-batches of 4: 3 micro-batches, 2 for one process and 1 for the other; two steps per batch
BATCH = [*SMALL_RUN, "training.micro_batch_size=4", "training.updates_per_batch=2", "run.device=cpu"]


def _update(tmp_path, run_id: str, *extra: str) -> RunDir:
    cfg = load_config(None, [*BATCH, f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *extra])
    run = RunDir.create(cfg)
    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    judge_stage(root, 0)
    score_stage(root, 0)
    advantage_stage.fn(root, 0)
    train_step_stage.fn(root, 0)
    checkpoint_stage.fn(root, 0)
    return run


def test_torchrun_update_equals_the_single_process_update(tmp_path):
    single = _update(tmp_path, "single")
    parallel = _update(tmp_path, "torchrun", "training.launcher=torchrun", "training.nproc=2")
    try:
        for name in (checkpoints.ADAPTER_FILE,):
            a = load_file(single.checkpoint_dir(0) / name)
            b = load_file(parallel.checkpoint_dir(0) / name)
            assert a.keys() == b.keys()
            moved = max(float((a[k] - load_file(single.checkpoint_dir(-1) / name)[k]).abs().max()) for k in a)
            assert moved > 1e-4  # the update did move the adapter
            # Summed over two processes the gradients differ from one process's in float rounding; Adam divides
            # each by its own magnitude, so an element whose gradient is at rounding level can move by a share of
            # the step either way (seen: 1 of 4,096 elements off by 4e-6). Every other element agrees to float
            # tolerance, and none is off by more than a twentieth of the largest move: a share of the batch left
            # out or counted twice moves many elements by a whole step.
            for key in a:
                off = (b[key] - a[key]).abs()
                assert float(off.max()) <= moved / 20, key
                assert float((off > 1e-6 + 1e-5 * a[key].abs()).float().mean()) <= 1e-3, key
        one = single.read(TRAIN_STEP, 0).to_pylist()[0]
        two = parallel.read(TRAIN_STEP, 0).to_pylist()[0]
        for name, value in one.items():
            if name in ("run_id", "update_seconds") or (isinstance(value, float) and math.isnan(value)):
                continue
            assert two[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        # the stage's process reloads the new weights from the checkpoint when it needs them
        res = resources.resources_for(parallel.root)
        assert res.roles[DEFAULT_ROLE].version is None
        res.ensure_version(0)
        for key, value in res.policy.adapter_state().items():
            torch.testing.assert_close(value, load_file(parallel.checkpoint_dir(0) / checkpoints.ADAPTER_FILE)[key])
    finally:
        resources.forget(single.root)
        resources.forget(parallel.root)


def test_a_refused_step_in_the_workers_is_the_same_error_as_in_process(tmp_path):
    # a tolerance below float rounding: the first-update check refuses the step in every process
    run = None
    with pytest.raises(RatioCheckError, match="does not see the distribution the tokens were sampled from"):
        run = _update(tmp_path, "r", "training.launcher=torchrun", "training.first_update_kl_tolerance=1e-30")
    run = RunDir(tmp_path / "r")
    assert run.completed(TRAIN_STEP, 0) is None and not run.path(TRAIN_STEP, 0).exists()
    assert not (run.checkpoint_dir(0) / checkpoints.ADAPTER_FILE).exists()  # nothing half-written either
    resources.forget(run.root)


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent to reap it has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_stopped_train_step_ends_its_torchrun_processes(tmp_path):
    from redteam_grpo.tasks import distributed_update

    child = tmp_path / "child.pid"
    script = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(300)"
    )
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)  # torchrun and a worker
    deadline = time.monotonic() + 30
    while not (child.exists() and child.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(child.read_text())
    distributed_update._stop(process)
    assert process.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "a worker outlived the stopped train step"
