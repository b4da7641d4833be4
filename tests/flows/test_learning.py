"""Proof that the loop learns on the embedded default, and that it is the advantage that drives it.

Margin: on the embedded default the mean reward of the first 5 iterations is ~0.08-0.13 (the tiny policy says a
marker word in ~10% of responses) and the last 5 reach ~0.46-0.67 (seeds 0-2, measured before this test was
written). A rise of 0.25 is far outside the iteration-to-iteration noise of the first iterations (std ~0.03 over
64 samples) and well inside what every seed reached.

Three-turn dialogues (dialogue.turns=3: the frozen base writes the user turns after the first, the policy is scored
on its last answer): the first 5 iterations average 0.06-0.08 and the last 5 0.27-0.30 (seeds 0-2, measured before
the test was written); the margin, 0.10, is half the smallest rise.

Per-turn rewards (dialogue.rewards=per_turn, discount 0.5: each answer paid for its own harm, each turn trained on
its return): the dialogue's return R_0 averages 0.18-0.20 over the first 5 iterations and 1.39-1.56 over the last 5,
and the last answer's harm rises from 0.11-0.12 to 0.80-0.95 (seeds 0-2, measured before the test was written).
One seed runs here; the margin, 0.6, is half the smallest rise.
"""

from __future__ import annotations

import pandas as pd
import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import TRAIN_STEP
from redteam_grpo.tasks import advantage as advantage_module

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness", "embedded_assets")]

MARGIN = 0.25
DIALOGUE_MARGIN = 0.10
PER_TURN_MARGIN = 0.6
ITERATIONS = ["run.iterations=30", "run.early_stop_reward=null", "run.early_stop_repetition=null"]


def _rewards(tmp_path, run_id, *overrides) -> pd.Series:
    cfg = load_config(None, [*ITERATIONS, f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *overrides])
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / run_id)
    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(cfg.run.iterations))
    assert metrics.ratio_mean.sub(1).abs().max() < 1e-5
    return metrics.reward_mean.reset_index(drop=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_reward_of_the_last_iterations_clearly_exceeds_the_first(tmp_path, seed):
    rewards = _rewards(tmp_path, f"learn-{seed}", f"run.seed={seed}")
    first, last = rewards.iloc[:5].mean(), rewards.iloc[-5:].mean()
    assert last - first > MARGIN, f"seed {seed}: first 5 {first:.3f}, last 5 {last:.3f}\n{rewards.round(3).tolist()}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_three_turn_attack_run_learns_on_its_own_turns(tmp_path, seed):
    rewards = _rewards(tmp_path, f"dialogue-{seed}", f"run.seed={seed}", "dialogue.turns=3")
    first, last = rewards.iloc[:5].mean(), rewards.iloc[-5:].mean()
    assert last - first > DIALOGUE_MARGIN, (
        f"seed {seed}: first 5 {first:.3f}, last 5 {last:.3f}\n{rewards.round(3).tolist()}"
    )


def test_a_three_turn_attack_run_with_per_turn_rewards_learns(tmp_path):
    settings = ["dialogue.turns=3", "dialogue.rewards=per_turn", "dialogue.discount=0.5"]
    rewards = _rewards(tmp_path, "per-turn", "run.seed=0", *settings)
    first, last = rewards.iloc[:5].mean(), rewards.iloc[-5:].mean()
    assert last - first > PER_TURN_MARGIN, f"first 5 {first:.3f}, last 5 {last:.3f}\n{rewards.round(3).tolist()}"


def test_with_the_advantage_sign_flipped_reward_goes_down(tmp_path, monkeypatch):
    real = advantage_module.group_advantages

    def flipped(*args, **kwargs):
        advantages, stats = real(*args, **kwargs)
        return -advantages, stats

    monkeypatch.setattr(advantage_module, "group_advantages", flipped)
    rewards = _rewards(tmp_path, "inverted", "run.iterations=20")
    first, last = rewards.iloc[:5].mean(), rewards.iloc[-5:].mean()
    assert last < first, f"first 5 {first:.3f}, last 5 {last:.3f}"
