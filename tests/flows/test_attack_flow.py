"""The red-team loop through Prefect: two iterations end to end, and a resume after an interruption."""

from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.storage import checkpoints, ownership
from redteam_grpo.storage.atomic import sha256_file
from redteam_grpo.storage.modes import ATTACK_MODE
from redteam_grpo.storage.rundir import RunDir, RunDirError
from redteam_grpo.storage.stages import ADVANTAGE, SAMPLE, SCORE, TRAIN_STEP
from redteam_grpo.tasks import advantage as advantage_module
from redteam_grpo.tasks import sample as sample_module
from tests import conftest
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")

SMALL = ["run.iterations=2", *SMALL_RUN]


def _config(tmp_path, run_id, *extra):
    return load_config(None, [*SMALL, f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *extra])


def test_two_iterations_write_every_stage_and_the_first_update_is_on_policy(tmp_path):
    cfg = _config(tmp_path, "e2e")
    run_dir = attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "e2e")
    assert str(run.root) == run_dir
    assert run.manifest()["status"] == "completed"
    for iteration in range(2):
        for stage in ATTACK_MODE.stages(cfg):
            assert run.completed(stage, iteration), (iteration, stage.name)
        checkpoints.read_manifest(run.checkpoint_dir(iteration))

    rollouts = pd.read_parquet(run.path(SAMPLE, 0))
    assert len(rollouts) == 3 * 4
    assert set(rollouts.columns) >= {"run_id", "iteration", "prompt_id", "sample_idx", "sampling_logprobs"}
    assert (rollouts.completion_length == rollouts.completion_token_ids.map(len)).all()
    assert (rollouts.sampling_logprobs.map(len) == rollouts.completion_length).all()

    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(2))
    assert metrics.ratio_mean.sub(1).abs().max() < 1e-5  # every iteration's first update is on-policy
    assert metrics.sampler_kl.abs().max() < 1e-8  # KL(sampler || trainer) on the first update
    # iteration 0 samples from the base: KL 0, up to the sampler's cached forward vs the base's whole one
    assert metrics.kl_base_mean.iloc[0] < 1e-9
    assert metrics.kl_base_mean.iloc[1] > 0.0  # after an update the policy has moved away from the base
    adapter_0 = load_file(str(run.checkpoint_dir(0) / checkpoints.ADAPTER_FILE))
    init = load_file(str(run.checkpoint_dir(-1) / checkpoints.ADAPTER_FILE))
    assert any(not torch.equal(adapter_0[k], init[k]) for k in init)

    # DuckDB reads the stage files directly
    import duckdb

    mean_reward = duckdb.sql(
        f"select avg(reward) from read_parquet('{run.root}/iter_*/advantages.parquet')"
    ).fetchall()[0]
    assert mean_reward[0] is not None
    assert not conftest.attempted_connections, conftest.attempted_connections


def test_resume_after_an_interruption_recomputes_nothing_and_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    reference_dir = attack.attack_run(config=_config(tmp_path, "straight").model_dump(mode="json"))

    cfg = _config(tmp_path, "interrupted")
    real_advantages = advantage_module.group_advantages

    def crash_on_iteration_1(rewards, *args, **kwargs):
        if crash_on_iteration_1.armed and crash_on_iteration_1.calls == 1:
            raise KeyboardInterrupt("simulated crash between score and advantage of iteration 1")
        crash_on_iteration_1.calls += 1
        return real_advantages(rewards, *args, **kwargs)

    crash_on_iteration_1.armed, crash_on_iteration_1.calls = True, 0
    monkeypatch.setattr(advantage_module, "group_advantages", crash_on_iteration_1)
    with pytest.raises(BaseException, match="simulated crash"):
        attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "interrupted")
    assert run.manifest()["status"] == "interrupted" and run.manifest()["interrupted_by"] == "SIGINT"
    assert run.completed(SCORE, 1) and not run.completed(ADVANTAGE, 1)
    before = {p: sha256_file(p) for p in run.root.rglob("*.parquet")}

    crash_on_iteration_1.armed = False
    sampled = []
    real_sample = sample_module.sample_completions
    monkeypatch.setattr(sample_module, "sample_completions", lambda *a, **k: sampled.append(1) or real_sample(*a, **k))
    attack.attack_run(resume=str(run.root))
    assert sampled == []  # iteration 1 had sampled already: not recomputed
    assert run.manifest()["status"] == "completed"
    for path, digest in before.items():
        assert sha256_file(path) == digest, f"{path} was rewritten"

    straight = RunDir.open(tmp_path / "straight")
    assert str(straight.root) == reference_dir
    for stage in (SAMPLE, SCORE, ADVANTAGE):
        a = pd.read_parquet(straight.path(stage, 1)).drop(columns="run_id")
        b = pd.read_parquet(run.path(stage, 1)).drop(columns="run_id")
        pd.testing.assert_frame_equal(a, b)
    a = load_file(str(straight.checkpoint_dir(1) / checkpoints.ADAPTER_FILE))
    b = load_file(str(run.checkpoint_dir(1) / checkpoints.ADAPTER_FILE))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_resume_with_a_changed_config_is_refused_naming_the_fields(tmp_path):
    cfg = _config(tmp_path, "changed", "run.iterations=1")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    changed = _config(tmp_path, "changed", "run.iterations=1", "reward.kl_weight=0.5", "sampling.group_size=3")
    with pytest.raises(RunDirError, match=r"differs .* in: reward\.kl_weight, sampling\.group_size"):
        attack.attack_run(config=changed.model_dump(mode="json"), resume=str(tmp_path / "changed"))
    # extending a run is allowed
    longer = _config(tmp_path, "changed", "run.iterations=2")
    attack.attack_run(config=longer.model_dump(mode="json"), resume=str(tmp_path / "changed"))
    assert RunDir.open(tmp_path / "changed").completed_iterations() == [0, 1]


def test_overrides_on_resume_change_the_stored_config_not_the_defaults(tmp_path):
    cfg = _config(tmp_path, "stored", "run.iterations=1", "reward.kl_weight=0.3", "reward.timeout_s=7")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    # Only run.iterations is given: kl_weight 0.3 and timeout_s 7 must stay (applied to the defaults they would
    # read as a refused change of reward.kl_weight, and a silent rewrite of reward.timeout_s).
    attack.attack_run(resume=str(tmp_path / "stored"), overrides=["run.iterations=2"])
    run = RunDir.open(tmp_path / "stored")
    stored = run.stored_config()
    assert run.completed_iterations() == [0, 1]
    assert (stored.run.iterations, stored.reward.kl_weight, stored.reward.timeout_s) == (2, 0.3, 7.0)


def test_a_damaged_checkpoint_is_never_trained_on_and_redo_recomputes_it_bit_for_bit(tmp_path):
    cfg = _config(tmp_path, "damaged", "run.iterations=2")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "damaged")
    longer = ["run.iterations=3"]
    scores = run.path(SCORE, 0)  # an earlier iteration's file, which continuing would not even read
    kept = scores.read_bytes()
    scores.write_bytes(kept[: len(kept) // 2])
    with pytest.raises(RunDirError) as err:
        attack.attack_run(resume=str(run.root), overrides=longer)
    assert str(scores) in str(err.value) and "--redo 0/score" in str(err.value)
    scores.write_bytes(kept)

    adapter = run.checkpoint_dir(1) / checkpoints.ADAPTER_FILE
    intact = adapter.read_bytes()
    flipped = bytearray(intact)
    flipped[-16] ^= 0xFF  # a weight's bytes, not the header: the file still loads
    adapter.write_bytes(bytes(flipped))
    with pytest.raises(RunDirError) as err:
        attack.attack_run(resume=str(run.root), overrides=longer)
    assert str(adapter) in str(err.value) and "--redo 1/train_step" in str(err.value)
    assert run.completed_iterations() == [0, 1]  # nothing was trained on the damaged weights

    attack.attack_run(resume=str(run.root), overrides=longer, redo="1/train_step")
    assert adapter.read_bytes() == intact  # the update of iteration 1 recomputed from checkpoint 0, bit for bit
    assert run.completed_iterations() == [0, 1, 2] and run.manifest()["status"] == "completed"


def test_a_run_owned_by_another_process_is_refused_before_it_writes_anything(tmp_path):
    run = RunDir.create(_config(tmp_path, "owned", "run.iterations=1"))
    before = run.manifest()
    refused = pytest.raises(ownership.RunOwnedElsewhere, match=f"owned by pid {os.getpid()} on ")
    with ownership.owning(run.root), refused:  # this test process stands in for another `run --resume`
        attack.attack_run(resume=str(run.root))
    assert run.manifest() == before
    assert not run.checkpoint_dir(-1).exists()


def test_a_run_that_prunes_old_checkpoints_resumes_and_reads(tmp_path):
    cfg = _config(tmp_path, "pruned", "run.iterations=2", "run.keep_checkpoints=1")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "pruned")
    assert not run.checkpoint_dir(0).exists()
    attack.attack_run(resume=str(run.root), overrides=["run.iterations=3"])
    assert run.completed_iterations() == [0, 1, 2] and run.manifest()["status"] == "completed"
    assert [run.read(TRAIN_STEP, i).column("iteration").to_pylist() for i in range(3)] == [[0], [1], [2]]


@pytest.mark.parametrize("stopped", [True, False], ids=["stop-behind-an-api-error", "plain-api-error"])
def test_a_stop_that_comes_back_as_the_stopped_apis_error_marks_the_run_interrupted(tmp_path, monkeypatch, stopped):
    # A Ctrl-C to the process group stops Prefect's API server too: the KeyboardInterrupt that reaches Prefect's
    # engine can come back as the connection error its crash report raised, the stop as its context (seen in
    # tests/e2e/test_cli.py's Ctrl-C test, once in five CI runs). The run is interrupted, not failed; an API error
    # with no stop behind it is a failure.
    import httpx

    from redteam_grpo.flows import runner

    def iteration_with_context(run_dir, run_id, number):
        try:
            raise KeyboardInterrupt if stopped else RuntimeError("no stop here")
        except BaseException:
            raise httpx.ConnectError("All connection attempts failed")  # noqa: B904 (while handling, as Prefect raises it)

    monkeypatch.setattr(runner, "iteration_runner", lambda runtime: iteration_with_context)
    with pytest.raises(httpx.ConnectError):
        attack.attack_run(config=_config(tmp_path, "stopped").model_dump(mode="json"))
    manifest = RunDir.open(tmp_path / "stopped").manifest()
    assert manifest["status"] == ("interrupted" if stopped else "failed")
    if stopped:
        assert manifest["interrupted_by"] == "SIGINT"
