"""Self-play: the attacker keeps learning with its own GRPO step, on the same base as the defender.

Two adapters on one copy of the base: each update runs with its own adapter active, against the logprobs its
own rollouts were sampled with, so the first-update ratio is 1 for both; an update that saw the other role's
adapter would be refused by the ratio check (the bug class `update-sees-another-roles-adapter`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from redteam_grpo.core.config import load_config
from redteam_grpo.flows.defense import defense_run
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ATTACK_SCORE, ATTACK_TRAIN_STEP, SCORE, TRAIN_STEP

pytestmark = [pytest.mark.usefixtures("prefect_harness", "embedded_assets")]

SMALL = [
    "logging.progress=false",
    "logging.artifacts=false",
    "data.prompts_per_iteration=4",
    "sampling.group_size=2",
    "defense.self_play=true",
    "defense.prompts_per_goal=2",
]


def _self_play(tmp_path, run_id: str, *overrides: str) -> RunDir:
    cfg = load_config(None, [f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *SMALL, *overrides], mode="defense")
    return RunDir.open(Path(defense_run(config=cfg.model_dump(mode="json"))))


def test_self_play_updates_both_adapters_each_on_its_own_rollouts(tmp_path, monkeypatch):
    # every learner's reward is assembled by one function: the attacker's KL and entropy forwards keep the
    # micro-batches' token cap as the defender's do (a copy of the assembly once passed no cap)
    from redteam_grpo.tasks import score

    caps: list[int | None] = []

    def recording(rows, lengths, size, tokens=None):
        caps.append(tokens)
        return score_micro_batches(rows, lengths, size, tokens)

    score_micro_batches = score.micro_batches
    monkeypatch.setattr(score, "micro_batches", recording)
    run = _self_play(tmp_path, "sp", "run.iterations=2", "training.micro_batch_tokens=4096")
    assert len(caps) == 4 and set(caps) == {4096}, caps  # two iterations, the defender's rows and the attacker's
    recorded = {k.split("/")[1] for k in run.manifest()["stages"] if k.startswith("1/")}
    assert recorded == {
        "attack",
        "sample",
        "judge",
        "score",
        "advantage",
        "train_step",
        "attack_score",
        "attack_advantage",
        "attack_train_step",
        "checkpoint",
    }
    for stage in (TRAIN_STEP, ATTACK_TRAIN_STEP):
        metrics = run.read(stage, 1).to_pylist()[0]
        assert abs(metrics["ratio_mean"] - 1) < 1e-5 and metrics["first_ratio_abs_dev"] < 1e-5, stage.name
    # the attacker's reward is the judge's verdict on the defender's responses to its prompts
    defender = run.read(SCORE, 1).to_pandas()
    attacker = run.read(ATTACK_SCORE, 1).to_pandas()
    defender["attack"] = defender.prompt_id.str.split("#").str[0] + "/" + defender.prompt_id.str.split("#").str[1]
    means = defender.groupby("attack").harm.mean()
    for row in attacker.itertuples():
        assert abs(row.harm - means[f"{row.prompt_id}/{row.sample_idx}"]) < 1e-12
    assert attacker.novelty.notna().all()
    # each checkpoint holds both adapters and both optimizers; the attacker moved, the base did not
    initial = load_file(run.checkpoint_dir(-1) / checkpoints.ATTACKER_FILE)
    for i in (0, 1):
        files = checkpoints.read_manifest(run.checkpoint_dir(i))["files"]
        assert {checkpoints.ATTACKER_FILE, checkpoints.ATTACKER_OPTIMIZER_FILE, checkpoints.ADAPTER_FILE} <= set(files)
    after = load_file(run.checkpoint_dir(1) / checkpoints.ATTACKER_FILE)
    assert any((after[k] != initial[k]).any() for k in initial)


def test_a_resumed_self_play_run_reloads_both_roles_and_matches_an_uninterrupted_one(tmp_path):
    whole = _self_play(tmp_path, "whole", "run.iterations=2")
    part = _self_play(tmp_path, "part", "run.iterations=1")
    cfg = load_config(None, ["run.iterations=2"], base=part.stored_config().model_dump(mode="json"), mode="defense")
    from redteam_grpo.tasks.resources import forget

    forget(part.root)  # a new process: nothing in memory
    defense_run(config=cfg.model_dump(mode="json"), resume=str(part.root))
    for name in (checkpoints.ADAPTER_FILE, checkpoints.ATTACKER_FILE):
        a, b = load_file(whole.checkpoint_dir(1) / name), load_file(part.checkpoint_dir(1) / name)
        assert all((a[k] == b[k]).all() for k in a), name
