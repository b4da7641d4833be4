"""The trainer scores through a real reward server: `redteam-grpo serve-reward` on a free loopback port.

Scores through HTTP equal in-process scores; when the server goes away, the judge stage fails after its
retries with a message that says how to go on, and the run resumes from that stage once a server is back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import pandas as pd
import pytest
import torch

from redteam_grpo.core.config import RewardConfig, load_config
from redteam_grpo.core.scoring.backend import build_local_scoring
from redteam_grpo.flows import attack
from redteam_grpo.server.client import RewardServiceError
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import JUDGE, SAMPLE, SCORE
from tests.e2e.test_cli import CLI, ROOT
from tests.processes import default_stop_signals
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`redteam-grpo serve-reward` as a user starts it, stopped with SIGTERM."""

    def __init__(self, log_path, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*CLI, "serve-reward", "--port", str(self.port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                preexec_fn=default_stop_signals,  # stopped with SIGTERM below, however this runner was started
            )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, "the server exited:\n" + log_path.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became ready:\n" + log_path.read_text()[-3000:]
            time.sleep(0.2)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)


def _config(tmp_path, url, iterations):
    return load_config(
        None,
        [
            f"run.iterations={iterations}",
            *SMALL_RUN,
            f"run.runs_dir={tmp_path}",
            "run.run_id=http",
            f"reward.url={url}",
            "reward.retries=1",
            "reward.backoff_s=0.05",
            "reward.timeout_s=20",
        ],
    )


def test_a_run_scores_through_the_server_and_resumes_after_the_server_went_away(tmp_path):
    server = ServerProcess(tmp_path / "server.log")
    try:
        cfg = _config(tmp_path, server.url, 2)
        attack.attack_run(config=cfg.model_dump(mode="json"))
        served = httpx.get(server.url + "/ready").json()
    finally:
        server.stop()
    assert served["batching"]["requests_served"] >= 2  # the run's texts went through this server
    assert "request_id=" in server.log_path.read_text()

    run = RunDir.open(tmp_path / "http")
    scores = pd.read_parquet(run.path(SCORE, 0))
    rollouts = pd.read_parquet(run.path(SAMPLE, 0))
    local = build_local_scoring(RewardConfig(), torch.device("cpu")).score(
        rollouts.completion_text.tolist(), rollouts.prompt.tolist()
    )
    assert scores.harm.tolist() == pytest.approx([s.score for s in local], abs=1e-5)
    assert scores.refusal.tolist() == [s.refusal for s in local]
    assert set(scores.scorer_name) == {"embedded:tiny-toxicity"}
    assert set(scores.scorer_revision) == {served["service"]["scorer"]["revision"]}

    # The server is gone: iteration 2 samples, then its judge stage fails after 1 + 1 attempts.
    with pytest.raises(RewardServiceError, match=r"failed 2 times.*--resume"):
        attack.attack_run(config=_config(tmp_path, server.url, 3).model_dump(mode="json"), resume=str(run.root))
    assert run.completed(SAMPLE, 2) and not run.completed(JUDGE, 2) and not run.completed(SCORE, 2)
    sampled = run.manifest()["stages"]["2/sample"]

    # A new server on another port; resuming with the new URL is allowed and runs the judge stage on (no sampling).
    server = ServerProcess(tmp_path / "server2.log")
    try:
        resumed = _config(tmp_path, server.url, 3)
        attack.attack_run(config=resumed.model_dump(mode="json"), resume=str(run.root))
    finally:
        server.stop()
    assert run.manifest()["status"] == "completed"
    assert run.manifest()["stages"]["2/sample"] == sampled  # not re-sampled
    assert len(pd.read_parquet(run.path(SCORE, 2))) == 12


def test_a_server_serving_another_label_is_refused_before_scoring(tmp_path):
    server = ServerProcess(tmp_path / "server.log", "--toxic-label", "non-toxic")
    try:
        with pytest.raises(RewardServiceError, match=r"reward\.toxic_label is 'toxic'"):
            attack.attack_run(config=_config(tmp_path, server.url, 1).model_dump(mode="json"))
    finally:
        server.stop()


def test_serve_reward_refuses_a_wrong_label_at_startup_and_lists_the_real_ones():
    out = subprocess.run(
        [*CLI, "serve-reward", "--toxic-label", "harm", "--port", str(_free_port())],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2
    assert '\'harm\' is not a label of embedded:tiny-toxicity; its labels are ["non-toxic", "toxic"]' in out.stderr


def test_serve_reward_refuses_to_bind_beyond_loopback_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "REDTEAM_GRPO_REWARD_TOKEN"}
    out = subprocess.run(
        [*CLI, "serve-reward", "--host", "0.0.0.0", "--port", str(_free_port())],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2 and "REDTEAM_GRPO_REWARD_TOKEN" in out.stderr


def test_a_run_spreads_scoring_over_replicas_and_survives_one_going_down(tmp_path):
    first, second = ServerProcess(tmp_path / "a.log"), ServerProcess(tmp_path / "b.log")
    urls = f"reward.url=[{first.url}, {second.url}]"
    try:
        overrides = [
            "run.iterations=1",
            *SMALL_RUN,
            f"run.runs_dir={tmp_path}",
            "run.run_id=replicas",
            urls,
            "reward.retries=1",
            "reward.backoff_s=0.05",
        ]
        attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
        served = [httpx.get(s.url + "/ready").json()["batching"]["requests_served"] for s in (first, second)]
        assert all(n >= 1 for n in served), served  # both replicas scored part of the iteration
        second.stop()  # a replica goes down between iterations
        more = [o.replace("run.iterations=1", "run.iterations=2") for o in overrides]
        run = RunDir.open(tmp_path / "replicas")
        attack.attack_run(config=load_config(None, more).model_dump(mode="json"), resume=str(run.root))
        assert run.manifest()["status"] == "completed"
        assert len(run.read(SCORE, 1)) == 12  # every text of iteration 1 scored, by the replica left
        assert httpx.get(first.url + "/ready").json()["batching"]["requests_served"] > served[0]
    finally:
        first.stop()
        if second.proc.poll() is None:
            second.stop()
