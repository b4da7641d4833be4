"""prefect.yaml against the production Prefect setup: `prefect server start` backed by PostgreSQL (a database of
its own per test session on 127.0.0.1:5432, as docker-compose.yml runs it) on a free loopback port, a process work
pool, `prefect deploy --all`, process workers, deployment runs triggered with parameters, their Parquet output checked;
load through it (four runs submitted at once queue on a GPU-slot limit of 1); and a worker killed with SIGKILL mid-run,
which deploy/unresponsive-runs.yaml marks Crashed. Everything started here is stopped here, the database dropped.

REDTEAM_GRPO_TEST_PREFECT_DB=sqlite runs the same tests on a SQLite server, for a machine without PostgreSQL;
REDTEAM_GRPO_TEST_POSTGRES names another PostgreSQL server (default postgresql://postgres@127.0.0.1:5432/postgres)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from redteam_grpo.storage import schemas
from redteam_grpo.storage.lineage import read_lineage
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ATTACK, SAMPLE, SCORE
from tests.processes import default_stop_signals

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
SMALL = ["run.iterations=1", "data.prompts_per_iteration=2", "sampling.group_size=2", "sampling.max_new_tokens=8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


POSTGRES = os.environ.get("REDTEAM_GRPO_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def _postgres(statement: str) -> None:
    async def run() -> None:
        connection = await asyncpg.connect(POSTGRES, timeout=10)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def prefect_database(tmp_path_factory):
    """The server's database URL: a PostgreSQL database created for this session (dropped after), or SQLite when
    REDTEAM_GRPO_TEST_PREFECT_DB=sqlite."""
    if os.environ.get("REDTEAM_GRPO_TEST_PREFECT_DB") == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('prefect-db') / 'prefect.db'}"
        return
    name = f"redteam_grpo_test_{uuid.uuid4().hex[:12]}"
    try:
        _postgres(f"CREATE DATABASE {name}")
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(
            f"PostgreSQL at {POSTGRES} cannot create a test database ({exc}): start it, point "
            "REDTEAM_GRPO_TEST_POSTGRES at one, or set REDTEAM_GRPO_TEST_PREFECT_DB=sqlite",
            pytrace=False,
        )
    host = POSTGRES.split("://", 1)[1].rsplit("/", 1)[0]
    try:
        yield f"postgresql+asyncpg://{host}/{name}"
    finally:
        _postgres(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory, embedded_assets, prefect_database):
    home = tmp_path_factory.mktemp("prefect-server")
    api = f"http://127.0.0.1:{_free_port()}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": prefect_database,
        # the worker lets these tests' callers put runs in their temporary folders (flows/deployment_guard.py)
        "REDTEAM_GRPO_DEPLOYMENT_ALLOW": "run.runs_dir",
    }
    port = api.split(":")[-1].split("/")[0]
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, so the whole server is stopped below
        preexec_fn=default_stop_signals,  # with SIGTERM, however this runner was started
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield api, env
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _prefect(env, *args, timeout=300) -> str:
    result = subprocess.run([*PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"prefect {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _call(method: str, url: str, **kwargs):
    """One API call, retried like Prefect's own client does: the server answers 503 for errors a client may retry
    (SQLite busy while a worker writes), and 429/502 likewise."""
    for attempt in range(8):
        response = httpx.request(method, url, timeout=30, **kwargs)
        if response.status_code not in (429, 502, 503):
            response.raise_for_status()
            return response.json() if response.content else None
        time.sleep(min(2**attempt, 10))
    return response.raise_for_status().json()


def _deployments(api) -> dict[str, dict]:
    return {d["name"]: d for d in _call("POST", f"{api}/deployments/filter", json={})}


def _trigger(api, deployment: dict, parameters: dict) -> str:
    url = f"{api}/deployments/{deployment['id']}/create_flow_run"
    return _call("POST", url, json={"parameters": parameters})["id"]


def _final_states(api, env, flow_run_ids: list[str]) -> dict[str, dict]:
    """Run process workers (one poll each) until every flow run is final; their states."""
    deadline = time.monotonic() + 480
    states = {}
    while time.monotonic() < deadline:
        states = {i: _call("GET", f"{api}/flow_runs/{i}")["state"] for i in flow_run_ids}
        if all(s["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states.values()):
            break
        _prefect(env, "worker", "start", "--pool", "redteam-grpo", "--run-once", "--limit", "4")
    return states


def _work_off(api, env, flow_run_ids: list[str]) -> None:
    """Run process workers until every flow run is final; fail on any that did not complete."""
    states = _final_states(api, env, flow_run_ids)
    assert {s["type"] for s in states.values()} == {"COMPLETED"}, states


@pytest.fixture(scope="module")
def deployments(prefect_server) -> dict[str, dict]:
    """`prefect deploy --all` into a process work pool; the deployments by name."""
    api, env = prefect_server
    _prefect(env, "work-pool", "create", "redteam-grpo", "--type", "process")
    _prefect(env, "--no-prompt", "deploy", "--all")
    return _deployments(api)


def test_prefect_deploy_all_then_worker_runs_the_deployments(prefect_server, deployments, tmp_path):
    api, env = prefect_server
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    assert set(deployments) == {d["name"] for d in spec}
    assert set(deployments) == {"red-team", "evaluation", "scheduled-retraining", "attacker-sft", "defense", "active"}
    limits = {d["name"]: d["concurrency_limit"]["limit"] for d in spec}
    for name, d in deployments.items():
        assert d["work_pool_name"] == "redteam-grpo"
        # the server enforces each deployment's bound on its runs at once, and queues the rest
        assert d["global_concurrency_limit"]["limit"] == limits[name], d["global_concurrency_limit"]
        assert d["concurrency_options"]["collision_strategy"] == "ENQUEUE", d["concurrency_options"]
        assert d["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
    (schedule,) = deployments["scheduled-retraining"]["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * 1" and schedule["active"]

    runs = tmp_path / "runs"
    attack = _trigger(
        api, deployments["red-team"], {"overrides": [*SMALL, f"run.runs_dir={runs}", "run.run_id=deployed"]}
    )
    # The scheduled deployment's own parameters (config file relative to the project, lineage), plus overrides.
    retrain = _trigger(
        api,
        deployments["scheduled-retraining"],
        {
            "lineage": "weekly",
            "config_path": "configs/retrain-nightly.yaml",
            "overrides": [*SMALL, f"run.runs_dir={runs}", "run.run_id=weekly-0"],
        },
    )
    # a caller who names a Ray cluster (whose replies Ray unpickles) is refused in the deployment's flow run itself
    refused = _trigger(
        api,
        deployments["red-team"],
        {"overrides": [*SMALL, f"run.runs_dir={runs}", "run.run_id=refused", "runtime.ray_address=ray://127.0.0.1:9"]},
    )
    _work_off(api, env, [attack, retrain])
    (state,) = _final_states(api, env, [refused]).values()
    assert state["type"] == "FAILED" and "runtime.ray_address" in state["message"], state
    assert not (runs / "refused").exists()

    deployed = RunDir.open(runs / "deployed")
    assert deployed.manifest()["status"] == "completed"
    rollouts = schemas.read_table(deployed.path(SAMPLE, 0), schemas.ROLLOUTS)
    scores = schemas.read_table(deployed.path(SCORE, 0), schemas.SCORES)
    assert rollouts.num_rows == scores.num_rows == 2 * 2
    weekly = RunDir.open(runs / "weekly-0")
    assert weekly.stored_config().run.name == "nightly"  # read from configs/retrain-nightly.yaml
    assert read_lineage(weekly).lineage == "weekly" and weekly.manifest()["status"] == "completed"

    evaluation = _trigger(
        api,
        deployments["evaluation"],
        {"run_dir": str(weekly.root), "options": {"num_prompts": 2, "samples_per_prompt": 2}},
    )
    _work_off(api, env, [evaluation])
    (written,) = (weekly.root / "eval").glob("iter_0000-*.parquet")
    table = pq.read_table(written)
    # held-out and benign prompts, base and adapter
    assert table.num_rows == 2 * 2 * 2 * 2 and set(table.column("policy").to_pylist()) == {"base", "adapter"}

    # Defense mode through its deployments: sft -> defense (the SFT run as attacker) -> evaluation.
    sft = _trigger(
        api,
        deployments["attacker-sft"],
        {"overrides": ["run.iterations=2", "data.max_prompts=32", f"run.runs_dir={runs}", "run.run_id=attacker"]},
    )
    _work_off(api, env, [sft])
    assert RunDir.open(runs / "attacker").manifest()["status"] == "completed"
    defense = _trigger(
        api,
        deployments["defense"],
        {"overrides": [*SMALL, f"run.runs_dir={runs}", "run.run_id=defended", f"defense.attacker={runs / 'attacker'}"]},
    )
    _work_off(api, env, [defense])
    defended = RunDir.open(runs / "defended")
    assert defended.manifest()["status"] == "completed"
    assert schemas.read_table(defended.path(ATTACK, 0), schemas.ROLLOUTS).num_rows == 2
    evaluation = _trigger(
        api,
        deployments["evaluation"],
        {"run_dir": str(defended.root), "options": {"num_prompts": 2, "samples_per_prompt": 2}},
    )
    _work_off(api, env, [evaluation])
    (written,) = (defended.root / "eval").glob("iter_0000-defense-*.parquet")
    rows = pq.read_table(written).to_pandas()
    assert set(rows.policy) == {"base", "defended"} and set(rows.set) == {"heldout_goals", "prompt_file", "benign"}


def _worker(env, log, *args: str) -> subprocess.Popen:
    """A process worker of the pool in its own process group, its output in `log`."""
    command = [*PREFECT, "worker", "start", "--pool", "redteam-grpo", *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _logged(api, flow_run: str, text: str) -> bool:
    """Whether the flow run sent a log line containing `text` to the API."""
    body = {"logs": {"flow_run_id": {"any_": [flow_run]}}, "limit": 200}
    return any(text in entry["message"] for entry in _call("POST", f"{api}/logs/filter", json=body))


def test_four_runs_submitted_at_once_queue_on_a_gpu_slot_limit_of_one_and_each_finishes(
    prefect_server, deployments, tmp_path
):
    """What a scheduled fleet meets: more runs than GPUs. None is lost, they hold the slot one at a time, each
    finishes, and the slot is released at the end (Prefect has had reports of leaked slots and waiters not woken).

    The test holds the one slot itself until all four runs are running and waiting for it, so the four queue on it
    whatever the machine's speed: left to race, a run still importing its libraries on a loaded 2-core machine could
    start after the first had finished, and nothing would have queued."""
    api, env = prefect_server
    _prefect(env, "gcl", "create", "gpu-load", "--limit", "1")
    held_by_test = _call(
        "POST", f"{api}/v2/concurrency_limits/increment-with-lease", json={"names": ["gpu-load"], "slots": 1}
    )["lease_id"]
    runs = tmp_path / "runs"
    flow_runs = [
        _trigger(
            api,
            deployments["red-team"],
            {"overrides": [*SMALL, f"run.runs_dir={runs}", f"run.run_id=queued-{k}", "runtime.gpu_slot=gpu-load"]},
        )
        for k in range(4)
    ]
    log = (tmp_path / "worker.log").open("w")
    worker = _worker(env, log, "--run-once", "--limit", "4")  # one worker takes all four at once
    try:
        deadline = time.monotonic() + 300
        waiting: set[str] = set()
        while len(waiting) < len(flow_runs):
            assert time.monotonic() < deadline, (
                f"waiting for the slot: {len(waiting)} of 4 runs\n" + (tmp_path / "worker.log").read_text()[-3000:]
            )
            for i in set(flow_runs) - waiting:
                state = _call("GET", f"{api}/flow_runs/{i}")["state"]
                assert state["type"] in ("SCHEDULED", "PENDING", "RUNNING"), state  # none may pass the held slot
                if state["type"] == "RUNNING" and _logged(api, i, "waiting for 1 slot(s) of the concurrency limit"):
                    waiting.add(i)
            time.sleep(1)
        assert all(not RunDir(runs / f"queued-{k}").completed_iterations() for k in range(4))
        _call("POST", f"{api}/v2/concurrency_limits/decrement-with-lease", json={"lease_id": held_by_test})
        _work_off(api, env, flow_runs)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        log.close()

    held = []  # from the first stage a run recorded to its last: inside its slot
    for k in range(4):
        run = RunDir.open(runs / f"queued-{k}")
        assert run.manifest()["status"] == "completed"
        assert schemas.read_table(run.path(SCORE, 0), schemas.SCORES).num_rows == 2 * 2
        done = sorted(entry["completed_at"] for entry in run.manifest()["stages"].values())
        held.append((done[0], done[-1]))
    held.sort()
    assert all(one[1] < next_one[0] for one, next_one in itertools.pairwise(held)), held
    print("slot held (first to last stage recorded):", *(f"{a[11:19]}-{b[11:19]}" for a, b in held))
    assert _call("GET", f"{api}/v2/concurrency_limits/gpu-load")["active_slots"] == 0


def _flow_run_heartbeats(api, flow_run: str) -> int:
    body = {
        "filter": {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run}"]},
            "occurred": {"since": "2000-01-01T00:00:00Z"},
        },
        "limit": 50,
    }
    return len(_call("POST", f"{api}/events/filter", json=body)["events"])


def test_a_flow_run_whose_processes_are_killed_is_marked_crashed_and_its_run_says_so_and_resumes(
    prefect_server, deployments, tmp_path
):
    """What an out-of-memory kill of a worker's container does: the worker and the flow run's process die with
    SIGKILL and nothing is recorded. deploy/unresponsive-runs.yaml marks the flow run Crashed in Prefect, the run
    directory reads as stopped unexpectedly (its manifest says running, no process owns it), and the resume it names
    continues from the last checkpoint."""
    api, env = prefect_server
    automation = yaml.safe_load((ROOT / "deploy" / "unresponsive-runs.yaml").read_text())
    automation["trigger"]["within"] = 50  # a heartbeat every 30 s (Prefect's shortest); the shipped window is 120 s
    _prefect(env, "automation", "create", "--from-json", json.dumps(automation))
    runs = tmp_path / "runs"
    root = runs / "killed"
    flow_run = _trigger(
        api,
        deployments["red-team"],
        {"overrides": [*SMALL, "run.iterations=500", f"run.runs_dir={runs}", "run.run_id=killed"]},
    )
    log = (tmp_path / "worker.log").open("w")
    worker = _worker(env, log, "--limit", "1")
    try:
        deadline = time.monotonic() + 300
        while not (
            (root / "manifest.json").is_file()
            and RunDir(root).completed_iterations()
            and _flow_run_heartbeats(api, flow_run)
        ):
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(1)
        owner = json.loads((root / "owner.lock").read_text())["pid"]
        os.kill(owner, signal.SIGKILL)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        log.close()

    deadline = time.monotonic() + 180
    while (state := _call("GET", f"{api}/flow_runs/{flow_run}")["state"])["type"] != "CRASHED":
        assert state["type"] == "RUNNING" and time.monotonic() < deadline, state
        time.sleep(2)
    assert "No heartbeat" in state["message"] and "redteam-grpo inspect RUN_DIR" in state["message"]

    inspect = subprocess.run(
        [sys.executable, "-m", "redteam_grpo.cli.main", "inspect", str(root)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = " ".join((inspect.stdout + inspect.stderr).split())  # the console writes to stderr, the table to stdout
    assert inspect.returncode == 0, said
    assert "run killed: stopped unexpectedly" in said and f"redteam-grpo run --resume {root}" in said, said

    done = RunDir(root).completed_iterations()
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "redteam_grpo.cli.main",
            "run",
            "--resume",
            str(root),
            "--set",
            f"run.iterations={len(done) + 1}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    run = RunDir(root)
    assert run.manifest()["status"] == "completed" and run.completed_iterations() == list(range(len(done) + 1))
