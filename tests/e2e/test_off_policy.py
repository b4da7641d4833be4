"""One step off-policy (training.max_staleness=1): iteration i + 1 drawn with the adapter after i - 1 while iteration
i's update runs, through a sampler in another process. The sampler is the stand-in that speaks vLLM's protocol
(tests/doubles/vllm_server.py), which draws with transformers and a seed, the same tokens every time: two runs can be
compared bit for bit, which another engine's batching does not promise. The real engine runs the same mode in
tests/e2e/test_vllm_engine.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterName,
    TaskRunFilter,
    TaskRunFilterName,
)

from redteam_grpo.core.config import load_config
from redteam_grpo.core.training.staleness import drawing_version
from redteam_grpo.flows import attack
from redteam_grpo.flows.defense import defense_run
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.rundir import RunDir, sha256_file
from redteam_grpo.storage.stages import ATTACK, ATTACK_TRAIN_STEP, BY_NAME, SAMPLE, TRAIN_STEP
from tests.e2e.test_cli import CLI, ROOT, _wait_until_recorded
from tests.e2e.test_reward_server_run import _free_port
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")
ITERATIONS = 4
STRAIGHT = "off-policy-straight"
OFF_POLICY = ["sampling.backend=vllm", "training.max_staleness=1", f"run.iterations={ITERATIONS}", *SMALL_RUN]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """The stand-in sampler on a free loopback port, serving the embedded attack policy."""
    yield from _served(tmp_path_factory, "embedded:tiny-qwen3")


@pytest.fixture(scope="module")
def defense_stand_in(tmp_path_factory):
    """The stand-in serving the defense base, on which the attacker's and the defender's adapters are loaded."""
    yield from _served(tmp_path_factory, "embedded:tiny-qwen3-safe")


def _served(tmp_path_factory, model: str):
    port = _free_port()
    log = tmp_path_factory.mktemp("stand-in") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "doubles" / "vllm_server.py"),
                *("--port", str(port), "--model", model),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the stand-in never answered /health:\n" + log.read_text()[-3000:]
        time.sleep(0.5)
    yield url
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _overrides(url: str, runs: Path, run_id: str) -> list[str]:
    return [*OFF_POLICY, f"sampling.vllm_url={url}", f"run.runs_dir={runs}", f"run.run_id={run_id}"]


@pytest.fixture(scope="module")
def straight(stand_in, tmp_path_factory) -> RunDir:
    """An uninterrupted one-step-off-policy run, in this process."""
    runs = tmp_path_factory.mktemp("straight")
    # a run id no other test uses: its task runs are found by name (`_task_runs`) in the process's Prefect database
    attack.attack_run(config=load_config(None, _overrides(stand_in, runs, STRAIGHT)).model_dump(mode="json"))
    return RunDir.open(runs / STRAIGHT)


def _task_runs(run_id: str) -> dict[str, list]:
    """The task runs of the run's flow run by name (a stage task's runs, `train_step-<suffix>`, under its stage's name),
    each list in order of start."""
    with get_client(sync_client=True) as client:
        (first,) = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[f"{run_id}-iteration-0"]))
        )
        flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[first.flow_run_id]))
        found: dict[str, list] = {}
        for task_run in client.read_task_runs(flow_run_filter=flow_run, limit=200):
            stem = task_run.name.rsplit("-", 1)[0]
            name = stem if stem in BY_NAME else task_run.name  # a stage's task run: its name and Prefect's suffix
            found.setdefault(name, []).append(task_run)
    return {name: sorted(runs, key=lambda r: r.start_time) for name, runs in found.items()}


def test_each_iteration_is_drawn_by_the_adapter_two_before_beside_the_update_and_trains_decoupled(straight):
    run = straight
    assert run.manifest()["status"] == "completed"
    for iteration in range(ITERATIONS):
        versions = set(run.read(SAMPLE, iteration).column("policy_version").to_pylist())
        assert versions == {drawing_version(iteration, 1)}, (iteration, versions)  # -1, -1, 0, 1
    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(ITERATIONS))
    assert metrics.staleness.tolist() == [0.0, 1.0, 1.0, 1.0]
    # iteration 0 is drawn by the weights it trains from: held to the first-update check, within its bound
    assert metrics.sampler_kl.iloc[0] <= metrics.sampler_kl_tolerance.iloc[0]
    # the later ones by weights one update behind: KL(behaviour || current) is reported, above any rounding bound
    assert (metrics.sampler_kl.iloc[1:] > metrics.sampler_kl_tolerance.iloc[1:]).all(), metrics.sampler_kl.tolist()

    # In Prefect, iteration i + 1's sample shard runs while iteration i's train step does (the shard started 6-13 ms
    # into train steps of 110-370 ms, the tiny model's, unloaded on a 2-core AMD EPYC: printed below).
    runs = _task_runs(STRAIGHT)
    steps = runs[TRAIN_STEP.name]
    assert len(steps) == ITERATIONS
    for iteration in range(ITERATIONS - 1):
        (shard,) = runs[f"sample-{iteration + 1}-shard-0"]
        step = steps[iteration]
        assert shard.start_time < step.end_time and step.start_time < shard.end_time, (iteration, shard, step)
        when = f"{step.start_time:%S.%f}-{step.end_time:%S.%f}", f"{shard.start_time:%S.%f}-{shard.end_time:%S.%f}"
        print(f"iteration {iteration}: train step {when[0]}, sample of iteration {iteration + 1} {when[1]}")
        # and judged there, with no weights of that update: done before iteration i + 1's own run starts
        (judged,), (following,) = runs[f"judge-{iteration + 1}-shard-0"], runs[f"{STRAIGHT}-iteration-{iteration + 1}"]
        assert shard.end_time <= judged.start_time and judged.end_time <= following.start_time, (judged, following)


def _same_adapters(left: RunDir, right: RunDir) -> None:
    for iteration in range(ITERATIONS):
        for name in (checkpoints.ADAPTER_FILE, checkpoints.OPTIMIZER_FILE):
            files = [r.checkpoint_dir(iteration) / name for r in (left, right)]
            assert sha256_file(files[0]) == sha256_file(files[1]), f"{name} of iteration {iteration} differs"


@pytest.mark.parametrize("kill_at", ["1/advantage", "2/sample", "2/judge", "2/score"])
def test_a_kill_9_during_the_overlap_resumes_to_the_same_adapters_byte_for_byte(straight, stand_in, tmp_path, kill_at):
    # Killed once iteration 1's advantage is recorded (the sample of iteration 2 is about to start beside its update),
    # once iteration 2's rollouts are (drawn beside it), once they are judged (beside it too), once iteration 2's
    # scores are: each resume ends with the uninterrupted run's adapters and optimizer states.
    args = [*_overrides(stand_in, tmp_path, "killed"), "logging.progress=false"]
    log_path = tmp_path / "killed.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*CLI, "run", *(a for s in args for a in ("--set", s))],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    root = tmp_path / "killed"
    try:
        _wait_until_recorded(proc, root, kill_at, log_path)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    attack.attack_run(resume=str(root))
    _same_adapters(RunDir.open(root), straight)


def test_on_ray_the_next_iterations_shards_are_drawn_on_workers_beside_the_update_as_the_local_runner_draws_them(
    straight, stand_in, tmp_path, monkeypatch
):
    # runtime.task_runner=ray: an iteration is a subflow run with prefect-ray's task runner, whose shards run in Ray's
    # workers; iteration i + 1's are submitted from the thread that draws ahead, beside iteration i's train step.
    # Each update here waits until the next iteration's rollouts are recorded before it steps: drawn beside it, they
    # are; drawn after it (synchronously), it waits in vain and fails. (Timestamps would not show it: the tiny
    # model's update, ~0.1 s, is shorter than a Ray task's dispatch on two busy cores.)
    import redteam_grpo.tasks.train_step as train_step_module

    update = train_step_module.update_in_memory

    def waits_for_the_next_rollouts(res, iteration, *rest):
        deadline = time.monotonic() + 120
        while iteration + 1 < ITERATIONS and not res.run.completed(SAMPLE, iteration + 1):
            assert time.monotonic() < deadline, f"iteration {iteration + 1} was not drawn beside update {iteration}"
            time.sleep(0.05)
        return update(res, iteration, *rest)

    monkeypatch.setattr(train_step_module, "update_in_memory", waits_for_the_next_rollouts)
    # a run id no other test uses: its iterations' flow runs are found by name in the process's Prefect database
    run_id = "off-policy-on-ray"
    overrides = [*_overrides(stand_in, tmp_path, run_id), "runtime.task_runner=ray", "runtime.ray_num_cpus=2"]
    attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
    run = RunDir.open(tmp_path / run_id)
    assert run.manifest()["status"] == "completed"
    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(ITERATIONS))
    assert metrics.staleness.tolist() == [0.0, 1.0, 1.0, 1.0]
    for iteration in range(ITERATIONS):
        ours, local = (r.read(SAMPLE, iteration).to_pandas() for r in (run, straight))
        assert set(ours.policy_version) == {drawing_version(iteration, 1)}, iteration
        # the same adapter drew the same tokens: the stand-in draws by seed, wherever the request comes from
        assert ours.completion_token_ids.map(list).tolist() == local.completion_token_ids.map(list).tolist()
    # iteration i + 1's shard is a child task run of iteration i's subflow run, and ran while its train step did
    with get_client(sync_client=True) as client:
        for iteration in range(ITERATIONS - 1):
            named = FlowRunFilter(name=FlowRunFilterName(any_=[f"{run_id}-iteration-{iteration}"]))
            (flow_run,) = client.read_flow_runs(flow_run_filter=named)
            of_it = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
            children = {  # a stage task's run by its stage's name, without Prefect's suffix
                t.name.rsplit("-", 1)[0] if t.name.startswith(TRAIN_STEP.name) else t.name: t
                for t in client.read_task_runs(flow_run_filter=of_it)
            }
            shard, step = children[f"sample-{iteration + 1}-shard-0"], children[TRAIN_STEP.name]
            assert shard.start_time < step.end_time and step.start_time < shard.end_time, (iteration, shard, step)


def test_a_resume_with_iteration_1_sealed_and_no_rollouts_of_2_draws_them_with_the_adapter_after_0(straight, tmp_path):
    # Bug class resume-draws-with-the-wrong-version (docs/bug-classes.md): the one state the overlap makes that a
    # synchronous run never leaves, iteration i sealed and i + 1 not sampled, made exactly by a redo of 2/sample. The
    # resume draws iteration 2 with the adapter after iteration 0, as the uninterrupted run did, not with the newest
    # one it finds sealed.
    copy = tmp_path / "redone"
    shutil.copytree(straight.root, copy)
    attack.attack_run(resume=str(copy), redo="2/sample")
    redone = RunDir.open(copy)
    assert set(redone.read(SAMPLE, 2).column("policy_version").to_pylist()) == {0}
    _same_adapters(redone, straight)


def test_a_three_turn_run_draws_the_policy_s_turns_with_the_adapter_two_before_and_the_attacker_s_with_the_base(
    stand_in, tmp_path
):
    overrides = [*_overrides(stand_in, tmp_path, "dialogue"), "dialogue.turns=3", "run.iterations=3"]
    attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
    run = RunDir.open(tmp_path / "dialogue")
    for iteration in range(3):
        rows = run.read(SAMPLE, iteration).to_pandas()
        drawn = rows.groupby("speaker").policy_version.unique().map(list).to_dict()
        assert drawn == {"policy": [drawing_version(iteration, 1)], "attacker": [-1]}, (iteration, drawn)
    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(3))
    assert metrics.staleness.tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("self_play", [False, True], ids=["defense", "self-play"])
def test_defense_draws_the_attacker_s_prompts_and_the_defender_s_answers_ahead_with_the_adapters_two_before(
    defense_stand_in, tmp_path, self_play
):
    run_id = "self-play" if self_play else "defense"  # the task runs are found by the run's name
    overrides = ["sampling.backend=vllm", "training.max_staleness=1", "run.iterations=3", f"run.runs_dir={tmp_path}"]
    overrides += [f"sampling.vllm_url={defense_stand_in}", f"run.run_id={run_id}"]
    overrides += [f"defense.self_play={str(self_play).lower()}"]
    overrides += ["data.prompts_per_iteration=4", "sampling.group_size=2", "defense.prompts_per_goal=2"]
    run = RunDir.open(Path(defense_run(config=load_config(None, overrides, mode="defense").model_dump(mode="json"))))
    assert run.manifest()["status"] == "completed"
    for iteration in range(3):
        drawn = drawing_version(iteration, 1)
        attacker = drawn if self_play else -1  # a learning attacker draws ahead too; a frozen one is its initial self
        assert set(run.read(ATTACK, iteration).column("policy_version").to_pylist()) == {attacker}
        assert set(run.read(SAMPLE, iteration).column("policy_version").to_pylist()) == {drawn}
    for stage in (TRAIN_STEP, ATTACK_TRAIN_STEP) if self_play else (TRAIN_STEP,):
        metrics = pd.concat(pd.read_parquet(run.path(stage, i)) for i in range(3))
        assert metrics.staleness.tolist() == [0.0, 1.0, 1.0], stage.name
    runs = _task_runs(run_id)
    for iteration in range(2):  # the attacker wrote iteration i + 1's prompts while iteration i's defender stepped
        (attack,), step = runs[ATTACK.name][iteration + 1 : iteration + 2], runs[TRAIN_STEP.name][iteration]
        assert attack.start_time < step.end_time, (iteration, attack, step)
