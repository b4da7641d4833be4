"""`sampling.backend=vllm` end to end: a run samples through a server that speaks vLLM's protocol (the stand-in of
tests/doubles/vllm_server.py, in its own process on a free loopback port), with each version's adapter loaded
under its own name, and logprobs that differ from the trainer's by a little, as another engine's kernels do."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import httpx
import pandas as pd
import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.server.vllm_client import PEFT_ADAPTER_FILE, adapter_name
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SAMPLE, SCORE, TRAIN_STEP
from tests.e2e.test_cli import ROOT
from tests.e2e.test_reward_server_run import _free_port
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")
NOISE = 0.01


@pytest.fixture
def stand_in(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "sampler.log").open("w")
    command = [sys.executable, "tests/doubles/vllm_server.py", "--port", str(port), "--logprob-noise", str(NOISE)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "sampler.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the stand-in never answered /health"
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


def test_a_run_samples_through_the_vllm_protocol_with_each_versions_adapter(tmp_path, stand_in):
    overrides = [
        "run.iterations=2",
        *SMALL_RUN,
        f"run.runs_dir={tmp_path}",
        "run.run_id=vllm",
        "sampling.backend=vllm",
        f"sampling.vllm_url={stand_in}",
        # the stand-in's noise (up to 0.01 nats a token, KL ~1e-5) is bfloat16-sized, above float32's tolerance
        "training.first_update_kl_tolerance=1e-3",
    ]
    attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
    run = RunDir.open(tmp_path / "vllm")
    assert run.manifest()["status"] == "completed"

    # the adapter the server holds is the last version's, by a name that is a digest of its weights
    served = {card["id"] for card in httpx.get(stand_in + "/v1/models").json()["data"]}
    latest = adapter_name("vllm", 0, run.root / "sampler" / "adapter-0000" / PEFT_ADAPTER_FILE)
    assert served == {"embedded:tiny-qwen3", latest}

    # both logprobs kept: the sampler's in the rollouts, the trainer's in the scores; their mismatch is measured
    for iteration in range(2):
        rollouts, scores = pd.read_parquet(run.path(SAMPLE, iteration)), pd.read_parquet(run.path(SCORE, iteration))
        deltas = [
            abs(s - t)
            for sampled, trainer in zip(rollouts.sampling_logprobs, scores.policy_logprobs, strict=True)
            for s, t in zip(sampled, trainer, strict=True)
        ]
        assert 1e-4 < max(deltas) <= NOISE + 1e-4
    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(2))
    assert ((metrics.logprob_mismatch_mean > NOISE / 10) & (metrics.logprob_mismatch_mean < NOISE)).all()
    assert (metrics.logprob_mismatch_max <= NOISE + 1e-4).all() and (metrics.logprob_mismatch_share == 0).all()
    assert not metrics.kl_base_mean.map(math.isnan).any()
