"""The command line as a user runs it: config errors, kill -9 and resume, inference from a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from redteam_grpo.storage.atomic import sha256_file
from redteam_grpo.storage.rundir import RunDir
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


@pytest.mark.usefixtures("embedded_assets")
def test_kill_9_mid_run_then_resume_completes_without_recomputing_or_losing_anything(tmp_path):
    args = ["run", *SMALL, "--set", "run.iterations=3", "--set", f"run.runs_dir={tmp_path}", "--set", "run.run_id=k9"]
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*CLI, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    manifest = tmp_path / "k9" / "manifest.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if manifest.is_file() and "1/sample" in json.loads(manifest.read_text())["stages"]:
            break
        assert proc.poll() is None, "the run ended before it could be killed:\n" + log_path.read_text()[-3000:]
        time.sleep(0.05)
    else:
        pytest.fail("iteration 1 never sampled")
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


def test_resume_of_a_folder_that_is_no_run_is_a_clear_error(tmp_path):
    out = _cli("run", "--resume", str(tmp_path))
    assert out.returncode == 2 and "is not a run directory" in out.stderr


def test_the_package_imports_without_prefect_for_core(tmp_path):
    # core is plain Python + torch: importing it must not import prefect
    code = "import sys, redteam_grpo.core.train, redteam_grpo.core.sampling; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(tmp_path))
    assert out.stdout.strip() == "False", out.stderr
