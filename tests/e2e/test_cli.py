"""The command line as a user runs it: config errors, kill -9 and resume, inference from a checkpoint."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from redteam_grpo.cli import reaper
from redteam_grpo.cli.signals import STOP_GRACE_SECONDS
from redteam_grpo.core.config import load_config
from redteam_grpo.storage import checkpoints, ownership
from redteam_grpo.storage.atomic import TMP_PREFIX, sha256_file
from redteam_grpo.storage.rundir import RunDir, RunDirError
from tests.processes import default_stop_signals, ignoring_sigint
from tests.small_runs import SMALL_RUN

ROOT = Path(__file__).resolve().parents[2]
# The CLI, with every connection outside loopback refused and recorded in $NETGUARD_LOG.
CLI = [sys.executable, "-c", "import tests.netguard as g; g.install(); from redteam_grpo.cli.main import app; app()"]
# Settings the suite sets for itself that would also quiet the CLI, hiding whether it quiets itself.
QUIETING_VARIABLES = (
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",
    "TRANSFORMERS_VERBOSITY",
)
SMALL = [arg for setting in [*SMALL_RUN, "logging.progress=false"] for arg in ("--set", setting)]


@pytest.fixture(autouse=True)
def network_log(tmp_path, monkeypatch):
    log = tmp_path / "network-attempts.log"
    monkeypatch.setenv("NETGUARD_LOG", str(log))
    yield log
    assert not log.exists(), f"the CLI tried to reach the network: {log.read_text()}"


def _cli(*args, timeout=300, **kwargs):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


def test_config_show_prints_every_default_documented():
    out = _cli("config", "show")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["reward"]["kl_weight"] == 0.1
    assert "# β: weight of the per-token KL(policy ‖ base) on the sampling distribution" in out.stdout


def test_mistyped_key_fails_before_any_work(tmp_path):
    out = _cli("run", "--set", "reward.kl_weigth=0.2", "--set", f"run.runs_dir={tmp_path}")
    assert out.returncode == 2
    assert "reward.kl_weigth: unknown key (did you mean `kl_weight`?)" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_non_finite_learning_rate_is_refused_before_any_work(tmp_path):
    out = _cli("run", "--set", "training.learning_rate=.inf", "--set", f"run.runs_dir={tmp_path}")
    assert out.returncode == 2
    assert "training.learning_rate: Input should be a finite number" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "setting, named",
    [
        ("model.policy=/no/such/dir", "model.policy=/no/such/dir: no such folder"),
        ("model.policy=Qwen/Qwen3-4B-Instruct-2507", "not in the local Hugging Face cache"),
        ("reward.scorer=no-such-owner-0/no-such-scorer", "reward.scorer=no-such-owner-0/no-such-scorer: not a folder"),
    ],
)
def test_a_model_that_cannot_load_offline_is_one_line_before_any_work(tmp_path, setting, named):
    out = _cli("run", "--set", setting, "--set", f"run.runs_dir={tmp_path}")
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert list(tmp_path.iterdir()) == []


_RESUME = "continue it with: redteam-grpo run --resume"


def _run_args(runs_dir: Path, run_id: str, iterations: int) -> list[str]:
    settings = [f"run.iterations={iterations}", f"run.runs_dir={runs_dir}", f"run.run_id={run_id}"]
    return ["run", *SMALL, *(arg for setting in settings for arg in ("--set", setting))]


def _start_run(
    runs_dir: Path, run_id: str, iterations: int, preexec_fn=default_stop_signals
) -> tuple[subprocess.Popen, Path]:
    """A run in its own process group (as a terminal job: SIGINT and SIGTERM at their defaults, however this
    runner was started), its output in a log file."""
    log_path = runs_dir / f"{run_id}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*CLI, *_run_args(runs_dir, run_id, iterations)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
            preexec_fn=preexec_fn,
        )
    return proc, log_path


def _wait_until_recorded(proc: subprocess.Popen, root: Path, key: str, log_path: Path) -> None:
    """Until the run records `key` ("1/sample"), in manifest.json or its iteration's records.json once sealed; the run
    must still be running."""
    from redteam_grpo.storage.stages import BY_NAME

    number, _, name = key.partition("/")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, RunDirError):
            if int(number) in RunDir(root).recorded_iterations(BY_NAME[name]):
                return
        assert proc.poll() is None, f"the run ended before {key}:\n" + log_path.read_text()[-3000:]
        time.sleep(0.05)
    pytest.fail(f"{key} was never recorded")


def _exit_and_output(proc: subprocess.Popen, log_path: Path, timeout: float, failure: str) -> tuple[int, str]:
    """The run's exit status and output once it ends; past `timeout` seconds its process group is killed and the
    test fails with `failure` and the output's end."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{failure}:\n" + log_path.read_text()[-3000:])
    return code, log_path.read_text()


def _adapter(root: Path, iteration: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(RunDir.open(root).checkpoint_dir(iteration) / checkpoints.ADAPTER_FILE))


@pytest.mark.usefixtures("embedded_assets")
def test_kill_9_mid_run_then_resume_completes_without_recomputing_or_losing_anything(tmp_path):
    proc, log_path = _start_run(tmp_path, "k9", iterations=3)
    _wait_until_recorded(proc, tmp_path / "k9", "1/sample", log_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    run = RunDir.open(tmp_path / "k9")
    done_before = dict(run.manifest()["stages"])
    digests = {rel: d for entry in done_before.values() for rel, d in entry["files"].items()}
    out = _cli("run", "--resume", str(run.root), "--verbose")  # the stage lines are Prefect INFO lines
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sample already completed, not recomputed" in out.stderr + out.stdout
    after = run.manifest()
    assert after["status"] == "completed"
    for key, entry in done_before.items():
        assert after["stages"][key]["completed_at"] == entry["completed_at"], f"{key} was recomputed"
    for rel, digest in digests.items():
        assert sha256_file(run.root / rel) == digest, f"{rel} changed"
    assert run.completed_iterations() == [0, 1, 2]

    out = _cli("infer", "--run", str(run.root), "--prompt", "Describe my neighbour.", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
    out = _cli("infer", "--run", str(run.root), "--prompt", "hi", "--checkpoint", "7")
    assert out.returncode == 2 and "completed checkpoints: [0, 1, 2]" in out.stderr


# How long a stopped run may take to end: the CLI's grace for unwinding (after it, its watcher marks the run and
# exits whatever is still running), then 10 s for the watcher and the process's end on a machine loaded by the other
# test worker (a run was once seen alive 10 s after its SIGTERM under a load of 6 on 2 cores; unloaded, on a 2-core
# AMD EPYC: 4.2 s).
STOPPED_WITHIN = STOP_GRACE_SECONDS + 10


@pytest.mark.usefixtures("embedded_assets")
def test_sigterm_mid_iteration_stops_within_seconds_and_resume_matches_an_uninterrupted_run(tmp_path):
    proc, log_path = _start_run(tmp_path, "term", iterations=2)
    root = tmp_path / "term"
    _wait_until_recorded(proc, root, "1/sample", log_path)
    os.kill(proc.pid, signal.SIGTERM)  # the process only, as `kill PID` or a Prefect worker's cancellation
    sent = time.monotonic()
    code, output = _exit_and_output(
        proc, log_path, STOPPED_WITHIN, f"still running {STOPPED_WITHIN:.0f} s after SIGTERM"
    )
    assert code == 143, output[-3000:]
    assert "Traceback" not in output and "BrokenPipeError" not in output, output[-3000:]
    assert "Crash detected" not in output, output[-3000:]  # Prefect's echo of the stop: the CLI says it once
    assert "Error logging to API" not in output, output[-3000:]  # the API server stopped with the CLI
    assert f"run term interrupted by SIGTERM: its completed stages are kept; {_RESUME} {root}" in output
    print(f"stopped {time.monotonic() - sent:.1f} s after SIGTERM")
    run = RunDir.open(root)
    assert run.manifest()["status"] == "interrupted" and run.manifest()["interrupted_by"] == "SIGTERM"
    assert "1/checkpoint" not in run.manifest()["stages"]
    ownership.refuse_if_owned(root)  # the lock went with the process

    # What writes killed mid-way leave, at any depth of the run directory.
    leftovers = [root / "iter_0001" / f"{TMP_PREFIX}999-scores.parquet", run.checkpoint_dir(0) / f"{TMP_PREFIX}999-x"]
    for path in leftovers:
        path.write_bytes(b"\0" * 1000)
    out = _cli("run", "--resume", str(root), "--verbose")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "removed 2 temporary files left by interrupted writes" in out.stderr + out.stdout
    assert not any(path.exists() for path in leftovers)
    assert run.manifest()["status"] == "completed" and run.completed_iterations() == [0, 1]

    straight = _cli(*_run_args(tmp_path, "straight", iterations=2))
    assert straight.returncode == 0, straight.stderr[-3000:]
    a, b = _adapter(tmp_path / "straight", 1), _adapter(root, 1)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"
    # byte for byte (metadata in a fixed order too), so comparing two runs' checksums means something
    for name in (checkpoints.ADAPTER_FILE, checkpoints.OPTIMIZER_FILE):
        files = [RunDir.open(r).checkpoint_dir(1) / name for r in (tmp_path / "straight", root)]
        assert sha256_file(files[0]) == sha256_file(files[1]), f"{name} is not the same file in both runs"


@pytest.mark.usefixtures("embedded_assets")
def test_ctrl_c_to_the_whole_process_group_stops_within_seconds_though_the_prefect_api_stops_too(tmp_path):
    proc, log_path = _start_run(tmp_path, "ctrl-c", iterations=2)
    root = tmp_path / "ctrl-c"
    _wait_until_recorded(proc, root, "0/score", log_path)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the ephemeral API server gets it too
    code, output = _exit_and_output(
        proc, log_path, STOPPED_WITHIN, f"still running {STOPPED_WITHIN:.0f} s after SIGINT"
    )
    assert code == 130, output[-3000:]
    assert f"run ctrl-c interrupted by SIGINT: its completed stages are kept; {_RESUME} {root}" in output
    assert "Crash detected" not in output, output[-3000:]  # Prefect's echo of the stop: the CLI says it once
    assert "Error logging to API" not in output, output[-3000:]  # the API server stopped with the CLI
    assert RunDir.open(root).manifest()["status"] == "interrupted"


@pytest.mark.usefixtures("embedded_assets")
def test_a_run_started_with_sigint_ignored_ignores_it_and_completes(tmp_path):
    # bug class inherited-sig-ign-overridden: `nohup`, a shell's background job or a service manager starts a run
    # with SIGINT ignored; the run used to install its own handler over SIG_IGN and stop on the next SIGINT
    proc, log_path = _start_run(tmp_path, "nohup", iterations=1, preexec_fn=ignoring_sigint)
    root = tmp_path / "nohup"
    _wait_until_recorded(proc, root, "0/sample", log_path)  # the CLI's handlers are in place: the run has begun
    os.kill(proc.pid, signal.SIGINT)  # `kill -INT PID`: a background job gets no terminal's Ctrl-C
    code, output = _exit_and_output(proc, log_path, 240, "the run never ended")
    assert code == 0, output[-3000:]
    assert "interrupted" not in output, output[-3000:]
    assert RunDir.open(root).manifest()["status"] == "completed"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the API server's watcher needs /proc")
@pytest.mark.usefixtures("embedded_assets")
def test_prefect_s_temporary_api_server_dies_with_a_cli_killed_with_sigkill(tmp_path):
    """kill -9 of the CLI alone (not its process group): no exit handler runs, and the API server Prefect started
    as its child used to live on as an orphan; the watcher started beside the CLI stops it."""
    proc, log_path = _start_run(tmp_path, "orphan", iterations=3)
    try:
        _wait_until_recorded(proc, tmp_path / "orphan", "0/sample", log_path)
        servers = reaper._servers_of(proc.pid)
        assert servers, "no temporary API server found: the test no longer sees what it checks"
        # and its shutdown's log records (an event flush cut short: CancelledError tracebacks) stay off the console
        (pid, _), *_ = servers
        assert b"PREFECT_SERVER_LOGGING_LEVEL=CRITICAL" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while any(map(reaper._alive, servers)):
            assert time.monotonic() < deadline, f"the API server {servers} outlived the CLI by 20 s"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run's process group


def test_a_resume_of_a_run_another_process_owns_is_refused_at_once_naming_it(tmp_path):
    run = RunDir.create(load_config(None, [f"run.runs_dir={tmp_path}", "run.run_id=owned"]))
    with ownership.owning(run.root):  # this test process stands in for the first `run --resume`
        out = _cli("run", "--resume", str(run.root), timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"run owned is owned by pid {os.getpid()} on " in out.stderr
    assert f"continue with: redteam-grpo run --resume {run.root}" in out.stderr
    assert "Starting temporary server" not in out.stderr


@pytest.mark.usefixtures("embedded_assets")
def test_a_default_run_prints_progress_and_table_only_and_verbose_adds_prefect_and_library_output(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in QUIETING_VARIABLES}  # the CLI's defaults, not the suite's
    env["PREFECT_HOME"] = str(tmp_path / "prefect")  # a database of its own, to read what the API received
    args = ["run", *SMALL, "--set", "run.iterations=1", "--set", f"run.runs_dir={tmp_path}"]

    quiet = _cli(*args, "--set", "run.run_id=quiet", env=env)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    shown = quiet.stdout + quiet.stderr
    for noise in ("Loading weights", "Finished in state", "Created task run", "Beginning flow run", "FutureWarning"):
        assert noise not in shown, f"{noise!r} on a default run's console:\n{shown[-3000:]}"
    assert "iterations" in quiet.stdout and "run directory:" in quiet.stderr
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:  # the API still got every line
        logged = [m for (m,) in db.execute("SELECT message FROM log")]
    assert logged.count("Finished in state Completed()") >= 7  # 5 stages, the iteration flow, the run flow
    assert any(m.startswith("iteration 0: reward") for m in logged)

    verbose = _cli(*args, "--set", "run.run_id=verbose", "--verbose", env=env)
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "Finished in state Completed()" in verbose.stderr and "Beginning flow run" in verbose.stderr


def test_a_failure_inside_a_prefect_task_is_the_error_line_alone(tmp_path):
    """evaluate on a damaged checkpoint fails inside its Prefect task: the console shows the CLI's one `error:` line,
    not Prefect's echo of the failed task run as well (nor a traceback)."""
    env = {k: v for k, v in os.environ.items() if k not in QUIETING_VARIABLES}
    done = _cli(
        "run", *SMALL, "--set", "run.iterations=2", "--set", f"run.runs_dir={tmp_path}", "--set", "run.run_id=r"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = tmp_path / "r" / "checkpoints" / "iter_0001" / checkpoints.MANIFEST_FILE
    manifest.write_text("{ damaged")
    out = _cli("evaluate", str(tmp_path / "r"), env=env)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error:") and str(manifest) in lines[0] and "--iteration" in lines[0], lines


def test_resume_of_a_folder_that_is_no_run_is_a_clear_error(tmp_path):
    out = _cli("run", "--resume", str(tmp_path))
    assert out.returncode == 2 and "is not a run directory" in out.stderr


def test_the_package_imports_without_prefect_for_core(tmp_path):
    # core is plain Python + torch: importing it must not import prefect
    code = (
        "import sys, redteam_grpo.core.training.train, redteam_grpo.core.rollouts.sampling; "
        "print('prefect' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(tmp_path))
    assert out.stdout.strip() == "False", out.stderr


def test_a_run_at_a_url_is_run_resumed_inspected_and_queried_by_its_url(tmp_path):
    url = f"file://{tmp_path}/runs"
    out = _cli("run", *SMALL, "--set", "run.iterations=1", "--set", f"run.runs_dir={url}", "--set", "run.run_id=u")
    assert out.returncode == 0, out.stderr
    assert f"run directory: {url}/u" in out.stderr
    out = _cli("run", "--resume", f"{url}/u", "--set", "run.iterations=2", "--set", "logging.progress=false")
    assert out.returncode == 0, out.stderr
    assert RunDir.open(f"{url}/u").completed_iterations() == [0, 1]
    out = _cli("inspect", f"{url}/u")
    assert out.returncode == 0, out.stderr
    assert "run u: completed, 2 iterations completed" in out.stderr and "\n   1 " in out.stdout
    # the first-update check's gates beside their bounds, per iteration
    check = out.stdout[out.stdout.index("first-update check") :]
    assert all(gate in check for gate in ("token", "first", "last", "turns", "sequence", "varentropy")), check
    out = _cli("inspect", f"{url}/u", "--sql", "select count(*) as n from rollouts")
    assert out.returncode == 0, out.stderr
    assert "24" in out.stdout  # 2 iterations x 3 prompts x 4 samples
    out = _cli("inspect", f"file://{tmp_path}/nowhere")
    assert out.returncode == 2 and "is not a run directory" in out.stderr + out.stdout
