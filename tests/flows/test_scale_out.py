"""Shards of the sample and score stages (runtime.shards): on Ray workers or one after the other in the run's
process they write the same rows; each part is recorded as it completes, a failed shard is retried alone and a
resumed run computes only the parts that are missing; a Ray worker killed mid-shard costs that shard alone."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.storage import query
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ADVANTAGE, SAMPLE, SCORE, TRAIN_STEP
from redteam_grpo.tasks import score as score_module
from tests.small_runs import SMALL_RUN, assert_same_rows

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")

SHARDED = [*SMALL_RUN, "data.prompts_per_iteration=4", "runtime.shards=2", "run.iterations=1"]
KEYS = ["prompt_id", "sample_idx"]


def _config(tmp_path, run_id, *extra):
    return load_config(None, [*SHARDED, f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *extra])


def _rows(run: RunDir, stage) -> pd.DataFrame:
    """The stage's rows as readers see them (every part), without the run id, in key order."""
    df = run.read(stage, 0).to_pandas().drop(columns="run_id")
    return df.sort_values(KEYS).reset_index(drop=True)


def test_ray_workers_write_the_same_rows_as_the_local_runner(tmp_path, monkeypatch):
    in_this_process: list[int] = []
    real = score_module.repetition_ratios
    monkeypatch.setattr(score_module, "repetition_ratios", lambda *a: in_this_process.append(1) or real(*a))
    local = RunDir(tmp_path / "local")
    attack.attack_run(config=_config(tmp_path, "local").model_dump(mode="json"))
    assert len(in_this_process) == 2  # the local runner: both shards here, one after the other
    in_this_process.clear()
    # a local Ray instance with 2 CPUs, started by the run: both shards run at once, in other processes
    cfg = _config(tmp_path, "ray", "runtime.task_runner=ray", "runtime.ray_num_cpus=2")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    ray = RunDir(tmp_path / "ray")
    assert not in_this_process  # every shard ran on a Ray worker

    for run in (local, ray):
        entry = run.manifest()["stages"]["0/sample"]
        assert entry["parts"] == [
            "iter_0000/rollouts-00000-of-00002.parquet",
            "iter_0000/rollouts-00001-of-00002.parquet",
        ]
        assert "shards" not in run.manifest() or not run.manifest()["shards"]  # folded into the stage records
    for stage in (SAMPLE, SCORE, ADVANTAGE):
        assert_same_rows(_rows(local, stage), _rows(ray, stage), exact=False)
    assert len(_rows(ray, SAMPLE)) == 4 * 4 and _rows(ray, SAMPLE).prompt_id.nunique() == 4
    # the statistics are computed once over every part: the same as over the one table
    for stage in (SAMPLE, SCORE):
        assert local.verify(stage, 0)["stats"] == pytest.approx(ray.verify(stage, 0)["stats"], nan_ok=True)
    metrics = [run.read(TRAIN_STEP, 0).to_pylist()[0] for run in (local, ray)]
    assert metrics[1]["reward_mean"] == pytest.approx(metrics[0]["reward_mean"], rel=1e-6)
    # SQL over the parts as one view
    assert query.query(ray, "select count(*) as n from rollouts join scores using (prompt_id, sample_idx)").n[0] == 16


def test_shards_have_their_own_seeds_and_whole_groups(tmp_path):
    attack.attack_run(config=_config(tmp_path, "s").model_dump(mode="json"))
    run = RunDir(tmp_path / "s")
    parts = [pd.read_parquet(p) for p in run.table_paths(SAMPLE, 0)]
    assert [p.prompt_id.nunique() for p in parts] == [2, 2]
    assert not set(parts[0].prompt_id) & set(parts[1].prompt_id)  # a group is never split across shards
    assert parts[0].sampling_seed.iloc[0] != parts[1].sampling_seed.iloc[0]


def test_a_failed_shard_is_retried_alone_and_a_resume_computes_only_missing_parts(tmp_path, monkeypatch):
    calls: list[int] = []
    real = score_module.repetition_ratios

    def flaky(completion_ids, n):  # the second shard's first attempt fails
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("worker lost")
        return real(completion_ids, n)

    monkeypatch.setattr(score_module, "repetition_ratios", flaky)
    attack.attack_run(config=_config(tmp_path, "retry", "runtime.shard_retries=1").model_dump(mode="json"))
    assert len(calls) == 3  # shard 0 once, shard 1 twice: the retry did not redo shard 0
    assert RunDir(tmp_path / "retry").manifest()["status"] == "completed"

    # no retries left: the stage fails, the completed part is recorded and kept
    calls.clear()
    with pytest.raises(RuntimeError, match="worker lost"):
        attack.attack_run(config=_config(tmp_path, "resume", "runtime.shard_retries=0").model_dump(mode="json"))
    run = RunDir(tmp_path / "resume")
    assert set(run.manifest()["shards"]["0/score"]) == {"0"}
    assert run.completed(SCORE, 0) is None
    first = run.part_path(SCORE, 0, 0, 2)
    stamp = first.stat().st_mtime_ns
    calls.clear()
    attack.attack_run(resume=str(run.root))
    assert len(calls) == 1  # only the missing shard
    assert first.stat().st_mtime_ns == stamp
    assert run.manifest()["status"] == "completed" and not run.manifest().get("shards")

    # the rows are those of a run that never failed
    monkeypatch.setattr(score_module, "repetition_ratios", real)
    attack.attack_run(config=_config(tmp_path, "clean").model_dump(mode="json"))
    for stage in (SAMPLE, SCORE, ADVANTAGE):
        pd.testing.assert_frame_equal(_rows(run, stage), _rows(RunDir(tmp_path / "clean"), stage))


def test_redo_drops_the_recorded_parts_of_a_stage_in_flight(tmp_path, monkeypatch):
    real = score_module.repetition_ratios
    calls: list[int] = []

    def failing_second(completion_ids, n):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("worker lost")
        return real(completion_ids, n)

    monkeypatch.setattr(score_module, "repetition_ratios", failing_second)
    with pytest.raises(RuntimeError):
        attack.attack_run(config=_config(tmp_path, "r", "runtime.shard_retries=0").model_dump(mode="json"))
    run = RunDir(tmp_path / "r")
    assert run.manifest()["shards"]["0/score"]
    run.forget_from(SAMPLE, 0)
    assert not run.manifest()["shards"]


def test_more_shards_than_prompts_is_refused_naming_both_settings(tmp_path):
    with pytest.raises(ValueError, match=r"runtime.shards=5 is more than data.prompts_per_iteration=4"):
        _config(tmp_path, "x", "runtime.shards=5")


def test_a_gpu_run_on_ray_without_gpus_for_its_shards_is_refused(tmp_path, monkeypatch):
    import torch

    from redteam_grpo.flows import runtime

    monkeypatch.setattr(runtime, "resolve_device", lambda device: torch.device("cuda"))
    cfg = _config(tmp_path, "g", "runtime.task_runner=ray")
    with pytest.raises(runtime.RuntimeSetupError, match=r"runtime.shard_gpus=1"):
        runtime.check_runtime(cfg)
    runtime.check_runtime(_config(tmp_path, "g", "runtime.task_runner=ray", "runtime.shard_gpus=0.5"))


def test_a_worker_drops_what_it_cached_for_another_session_of_the_run(tmp_path):
    from redteam_grpo.tasks import resources

    run = RunDir.create(_config(tmp_path, "w"))
    try:
        first = resources.resources_for(run.root, "session-1")
        assert resources.resources_for(run.root, "session-1") is first
        assert resources.resources_for(run.root) is first  # the owner's own calls name no session
        second = resources.resources_for(run.root, "session-2")  # the run resumed or redone: other weights
        assert second is not first and second.session == "session-2"
    finally:
        resources.forget(run.root)


def test_a_ray_address_nothing_answers_at_is_an_error_at_once(tmp_path):
    import socket

    from redteam_grpo.flows import runtime

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = _config(tmp_path, "a", "runtime.task_runner=ray", f"runtime.ray_address=ray://127.0.0.1:{port}")
    with pytest.raises(runtime.RuntimeSetupError, match=r"nothing answers at runtime.ray_address='ray://127.0.0.1"):
        runtime.ray_session(cfg.runtime).__enter__()
    no_port = _config(tmp_path, "b", "runtime.task_runner=ray", "runtime.ray_address=head").runtime
    with pytest.raises(runtime.RuntimeSetupError, match="fix the address"):
        runtime.ray_session(no_port).__enter__()


def _ray_workers_running(task_name: str) -> list[int]:
    """Ray worker processes running the Prefect task `task_name` now (their title is ray::<task name> while they
    do, ray::IDLE after)."""
    busy = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title == f"ray::{task_name}".encode():
                busy.append(int(entry.name))
    return busy


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds Ray's workers through /proc")
def test_a_ray_worker_killed_mid_shard_costs_that_shard_alone_and_the_rows_are_an_unbroken_run_s(tmp_path):
    """What an out-of-memory kill of a Ray worker does: SIGKILL while it computes the second shard of the sample
    stage (one CPU: the shards run one after the other, so the first part is recorded by then). The run completes,
    the first part is not written again, and every table equals a run on the local runner."""
    extra = ("runtime.task_runner=ray", "runtime.ray_num_cpus=1", "runtime.shard_retries=1")
    run = RunDir(tmp_path / "killed")
    first, second = (run.part_path(SAMPLE, 0, k, 2) for k in (0, 1))
    seen: dict[str, object] = {}

    def kill_mid_second_shard() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and "killed" not in seen:
            # the first part recorded (not only written: its worker may still be returning it), the second not yet
            if run.manifest_path.exists() and run.completed_part(SAMPLE, 0, 0) and not second.exists():
                workers = _ray_workers_running("sample-shard")
                if workers:
                    seen["first_written"] = first.stat().st_mtime_ns
                    for pid in workers:
                        os.kill(pid, signal.SIGKILL)
                    seen["killed"] = workers
            time.sleep(0.02)

    killer = threading.Thread(target=kill_mid_second_shard, daemon=True)
    killer.start()
    attack.attack_run(config=_config(tmp_path, "killed", *extra).model_dump(mode="json"))
    killer.join(5)
    assert seen.get("killed"), "no Ray worker was found computing the second shard: nothing was killed"
    assert run.manifest()["status"] == "completed"
    assert first.stat().st_mtime_ns == seen["first_written"]  # the shard that had completed was not computed again
    attack.attack_run(config=_config(tmp_path, "local").model_dump(mode="json"))
    for stage in (SAMPLE, SCORE, ADVANTAGE):
        assert_same_rows(_rows(RunDir(tmp_path / "local"), stage), _rows(run, stage), exact=False)
