"""Proof that the loop learns on the embedded default, and that it is the advantage that drives it.

Each claim is over three seeds: the mean rise (last 5 iterations' mean reward minus the first 5's) over the seeds
clears a margin, and every seed rises. The embedded models are shipped (embedded/shipped.py), so every machine starts
from the same weights; its own kernels still sum in their own order during the 30 iterations, so the margins are
checked on the kernel sets of the machines they were measured on (seeds 0-2, 30 iterations).

Single turn, on the shipped models: an AMD EPYC rose by 0.565, 0.425 and 0.506 (a mean of 0.499) with its AVX-512
kernels and by 0.565, 0.427 and 0.506 (0.499) with ATEN_CPU_CAPABILITY=avx2. Before the models were shipped, each
machine trained its own and the curves differed more: rises of 0.33-0.56 per seed on one machine, 0.47, 0.10 and
0.47 on another (seed 1 reached 0.30 at iteration 19, fell to 0.02 and recovered), 0.47, 0.02 and 0.47 on an AVX2-only
one, 0.30, 0.01 and 0.30 on a Xeon with AVX-512 (its seed 1 reached 0.36 at iteration 23 and fell to -0.07 at the
last). A seed's policy can collapse for a while and come back (group-relative updates on 8 prompts), so
the end of one seed says little: the mean rise carries the claim, and every seed must have learned on the way, its
best 5-iteration mean above its first 5 by 0.1 (at least 0.425 on the shipped models; 0.16-0.17 for the collapsed seeds
above). The noise of a 5-iteration mean is ~0.02 (the first iterations' rewards vary by ~0.03 over 64 samples), so
~0.015 for a mean rise over three seeds: the margin, 0.15, is ten times that, below every machine's mean (0.499 here:
3.3 times the margin).

Three-turn dialogues (dialogue.turns=3: the frozen base writes the user turns after the first, the policy is scored
on its last answer), on the shipped models, with the sampler's present draw (one inverse-CDF draw per step; the
earlier draw's stream gave 0.189, 0.205 and 0.243 under both kernel sets): seeds 0-2 rose by 0.051, 0.114 and 0.121
on an AMD EPYC's AVX-512 kernels, and seeds 0 and 2 by 0.138 and 0.144 on its avx2 kernels (ATEN_CPU_CAPABILITY=avx2;
the curves agree to iteration 13, then part). Seed 0 does not learn within 30 iterations on AVX-512 (first 10
iterations' mean 0.072, last 10's 0.076; slope 0.44 standard errors): a terminal reward over three turns is a weak
signal at this size, and a seed's run can stall. So this test shows that a three-turn run learns from its terminal
reward at all, not that every seed does: it runs seed 2, which rose under both kernel sets, against a margin of 0.06,
twice the noise of a 5-iteration mean's rise (per-iteration noise ~0.05, so ~0.03) and 0.50x / 0.42x its two rises
(three seeds cost nine minutes on 2 cores). Multi-turn learning's strong claim is the per-turn test's below.

Per-turn rewards (dialogue.rewards=per_turn, discount 0.5: each answer paid for its own harm, each turn trained on
its return): the dialogue's return R_0 rose by 1.224 on the shipped models under both kernel sets (from 0.18 to
1.41); before, from 0.18-0.20 to 1.39-1.56 on one machine, from 0.17 to 1.26 on another (seed 0). One seed runs
here; the margin, 0.6, is about half the smallest rise.

With the advantage's sign flipped, the reward falls: the first 5 iterations' mean 0.095, the last 5's 0.006, under
both kernel sets.
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

SEEDS = (0, 1, 2)
MARGIN, BEST_WINDOW_FLOOR = 0.15, 0.1
DIALOGUE_MARGIN, DIALOGUE_SEED = 0.06, 2
PER_TURN_MARGIN = 0.6
ITERATIONS = ["run.iterations=30", "run.early_stop_reward=null", "run.early_stop_repetition=null"]


def _rewards(tmp_path, run_id, *overrides) -> pd.Series:
    cfg = load_config(None, [*ITERATIONS, f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *overrides])
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / run_id)
    metrics = pd.concat(pd.read_parquet(run.path(TRAIN_STEP, i)) for i in range(cfg.run.iterations))
    assert metrics.ratio_mean.sub(1).abs().max() < 1e-5
    return metrics.reward_mean.reset_index(drop=True)


def _rise(rewards: pd.Series) -> float:
    return rewards.iloc[-5:].mean() - rewards.iloc[:5].mean()


def _best_window_rise(rewards: pd.Series) -> float:
    """The best 5-iteration mean reward minus the first 5's: how far a seed got, wherever it ended."""
    return rewards.rolling(5).mean().max() - rewards.iloc[:5].mean()


def _curves(rewards_by_seed: dict[int, pd.Series]) -> str:
    return "\n".join(
        f"seed {s}: rise {_rise(r):.3f}, best window {_best_window_rise(r):.3f} {r.round(3).tolist()}"
        for s, r in rewards_by_seed.items()
    )


def _assert_learns(rewards_by_seed: dict[int, pd.Series]) -> None:
    """The mean rise over the seeds clears MARGIN, and each seed's best window clears BEST_WINDOW_FLOOR."""
    rises = [_rise(r) for r in rewards_by_seed.values()]
    print(f"mean rise {sum(rises) / len(rises):.3f} (margin {MARGIN})\n{_curves(rewards_by_seed)}")  # pytest -rP
    assert sum(rises) / len(rises) > MARGIN, _curves(rewards_by_seed)
    assert min(map(_best_window_rise, rewards_by_seed.values())) > BEST_WINDOW_FLOOR, _curves(rewards_by_seed)


def _assert_rises(rewards: pd.Series, margin: float, seed: int = 0) -> None:
    """One seed's rise clears `margin`."""
    print(f"rise {_rise(rewards):.3f} (margin {margin})\n{_curves({seed: rewards})}")  # pytest -rP
    assert _rise(rewards) > margin, _curves({seed: rewards})


def test_mean_reward_of_the_last_iterations_clearly_exceeds_the_first(tmp_path):
    _assert_learns({s: _rewards(tmp_path, f"learn-{s}", f"run.seed={s}") for s in SEEDS})


def test_a_three_turn_attack_run_learns_on_its_own_turns(tmp_path):
    rewards = _rewards(tmp_path, "dialogue", f"run.seed={DIALOGUE_SEED}", "dialogue.turns=3")
    _assert_rises(rewards, DIALOGUE_MARGIN, DIALOGUE_SEED)


def test_a_three_turn_attack_run_with_per_turn_rewards_learns(tmp_path):
    settings = ["dialogue.turns=3", "dialogue.rewards=per_turn", "dialogue.discount=0.5"]
    _assert_rises(_rewards(tmp_path, "per-turn", "run.seed=0", *settings), PER_TURN_MARGIN)


def test_with_the_advantage_sign_flipped_reward_goes_down(tmp_path, monkeypatch):
    real = advantage_module.group_advantages

    def flipped(*args, **kwargs):
        advantages, stats = real(*args, **kwargs)
        return -advantages, stats

    monkeypatch.setattr(advantage_module, "group_advantages", flipped)
    rewards = _rewards(tmp_path, "inverted", "run.iterations=20")
    first, last = rewards.iloc[:5].mean(), rewards.iloc[-5:].mean()
    print(f"first 5 {first:.3f}, last 5 {last:.3f}")  # pytest -rP
    assert last < first, f"first 5 {first:.3f}, last 5 {last:.3f}"
