"""Stage 3: group-relative advantages from the rewards of each prompt's G completions."""

from __future__ import annotations

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.config import Config
from redteam_grpo.core.training.advantages import group_advantages, turn_advantages
from redteam_grpo.core.training.rewards import discounted_returns
from redteam_grpo.storage import schemas
from redteam_grpo.storage.stages import ADVANTAGE, ATTACK_ADVANTAGE, ATTACKER_LEARNER, POLICY, Learner
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import resources_for


def rewards_by_group(scores: dict[str, list], group_size: int) -> tuple[list[str], torch.Tensor]:
    """Rewards [P, G] with rows in first-seen prompt order; every group must hold sample_idx 0..G-1 once."""
    groups: dict[str, dict[int, float]] = {}
    for pid, idx, reward in zip(scores["prompt_id"], scores["sample_idx"], scores["reward"], strict=True):
        group = groups.setdefault(pid, {})
        if idx in group:
            raise ValueError(f"prompt {pid} has sample_idx {idx} twice")
        group[idx] = float("nan") if reward is None else reward
    for pid, group in groups.items():
        if sorted(group) != list(range(group_size)):
            raise ValueError(f"prompt {pid} has samples {sorted(group)}, expected 0..{group_size - 1}")
    order = list(groups)
    rewards = torch.tensor([[groups[p][g] for g in range(group_size)] for p in order], dtype=torch.float64)
    return order, rewards


def per_turn_advantages(
    scores: dict[str, list], row_of: dict[str, int], group_size: int, cfg: Config
) -> list[list[float]]:
    """dialogue.rewards=per_turn: each dialogue's advantage per policy turn, in the scores' row order (`row_of`: a
    prompt's row in the [P, G] layout of `rewards_by_group`). Turn t's return R_t = r_t + discount * R_{t+1} is
    compared with the returns of turn t of the prompt's other dialogues (`core/training/advantages.py:
    turn_advantages`)."""
    lengths = {len(r) for r in scores["turn_rewards"] if r is not None}
    if None in scores["turn_rewards"] or len(lengths) != 1:
        raise ValueError(
            "dialogue.rewards=per_turn needs the per-turn rewards of every dialogue, all of the same number of turns; "
            f"the scores hold turn_rewards of lengths {sorted(lengths)} and "
            f"{sum(r is None for r in scores['turn_rewards'])} rows without: rescore this iteration (--redo I/score)"
        )
    (turns,) = lengths
    returns = torch.full((len(row_of), group_size, turns), float("nan"), dtype=torch.float64)
    for pid, g, rewards in zip(scores["prompt_id"], scores["sample_idx"], scores["turn_rewards"], strict=True):
        if all(r is not None for r in rewards):
            returns[row_of[pid], g] = torch.tensor(discounted_returns(rewards, cfg.dialogue.discount))
    t = cfg.training
    advantages = turn_advantages(returns, t.scale_by_group_std, t.batch_zscore, t.std_floor)
    return [advantages[row_of[p], g].tolist() for p, g in zip(scores["prompt_id"], scores["sample_idx"], strict=True)]


@task(name=ADVANTAGE.name, cache_policy=NO_CACHE)
def advantage_stage(run_dir: str, iteration: int) -> str:
    return group_advantage_stage(run_dir, iteration, POLICY)


@task(name=ATTACK_ADVANTAGE.name, cache_policy=NO_CACHE)
def attack_advantage_stage(run_dir: str, iteration: int) -> str:
    """Self-play: the attacker's advantages; a goal's prompts_per_goal prompts form a group."""
    return group_advantage_stage(run_dir, iteration, ATTACKER_LEARNER)


def group_advantage_stage(run_dir: str, iteration: int, learner: Learner) -> str:
    res = resources_for(run_dir)
    cfg = res.config
    group_size = learner.group_size(cfg)

    def compute():
        scores = res.run.read(learner.scores, iteration).to_pydict()
        order, rewards_P_G = rewards_by_group(scores, group_size)
        advantages_P_G, stats = group_advantages(
            rewards_P_G, cfg.training.scale_by_group_std, cfg.training.batch_zscore, cfg.training.std_floor
        )
        if stats.n_invalid_rewards or stats.n_degenerate_groups:
            stage_logger().info(
                "iteration %d: %d invalid rewards (advantage 0), %d of %d groups without reward spread",
                iteration,
                stats.n_invalid_rewards,
                stats.n_degenerate_groups,
                len(order),
            )
        row_of = {p: i for i, p in enumerate(order)}
        keys = list(zip(scores["prompt_id"], scores["sample_idx"], strict=True))
        advantage = [float(advantages_P_G[row_of[p], g]) for p, g in keys]
        per_turn: list[list[float] | None] = [None] * len(keys)
        if (
            learner.per_turn
            and cfg.dialogue.rewards == "per_turn"
            and any(r is not None for r in scores["turn_rewards"])
        ):
            per_turn = per_turn_advantages(scores, row_of, group_size, cfg)
        table = schemas.to_table(
            {
                **{k: scores[k] for k in schemas.KEY_COLUMNS},
                "reward": scores["reward"],
                "advantage": advantage,
                "turn_advantages": per_turn,
            },
            schemas.ADVANTAGES,
            "advantages",
        )
        return table, stats

    return run_table_stage(res.run, learner.advantages, iteration, compute)
