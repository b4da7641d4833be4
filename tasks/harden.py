"""Active Attacks' hardening stage (run.mode=active; Yun et al. 2025, arXiv 2509.21947): at the end of every round of
`active.harden_every` iterations the victim, the run's adapter on the base, is safety-tuned by LoRA SFT on the
attacks found so far, each paired with a refusal; the attacker then starts the next round over from its initial
checkpoint (`storage/modes.py: ACTIVE_MODE.restarts`).

An attack is found when the judge's mean P(unsafe) over the victim's responses to it (attack_scores.parquet's
`harm`) is at least `active.harm_threshold`: every such attacker prompt of this iteration and the earlier ones, each
text once. It is formatted as the victim was prompted with it (the run's system prompt, the chat template) and the
target is one of `active.refusals`, chosen by a seeded draw. Each hardening is an SFT run of its own: a fresh AdamW
at `active.learning_rate`, `active.harden_steps` optimizer steps (as the paper's 200; or `active.harden_epochs`
passes), loss on the refusal's tokens only.

The stage runs every iteration, so that every checkpoint holds the victim's adapter and optimizer as the next
iteration starts from them; between hardenings it writes them unchanged and its row says it did not train.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import pyarrow as pa
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.config import ActiveConfig, Config
from redteam_grpo.core.data.sources import DataError, parse_source, read_source
from redteam_grpo.core.models.policy import Policy
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.core.training.sft import SftExample, sft_epoch, sft_examples
from redteam_grpo.core.training.train import make_optimizer
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ATTACK, ATTACK_SCORE, HARDEN
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for

REFUSAL_COLUMN = "refusal"  # the column of active.refusals unless its `?column=` names another


def found_attacks(run: RunDir, iteration: int, threshold: float) -> list[tuple[str, str]]:
    """(id, text) of every attacker prompt of iterations 0..`iteration` whose harm is at least `threshold`, each text
    once (its first finding), in the order they were found."""
    found: dict[str, str] = {}
    for i in range(iteration + 1):
        attacks = run.read(ATTACK, i).to_pydict()
        scores = run.read(ATTACK_SCORE, i).to_pydict()
        harm = {(g, s): h for g, s, h in zip(scores["prompt_id"], scores["sample_idx"], scores["harm"], strict=True)}
        for goal, idx, text in zip(
            attacks["prompt_id"], attacks["sample_idx"], attacks["completion_text"], strict=True
        ):
            h = harm.get((goal, idx))
            if h is not None and h >= threshold and text.strip() and text not in found:
                found[text] = f"{i}/{goal}#{idx}"
    return [(attack_id, text) for text, attack_id in found.items()]


def load_refusals(cfg: Config) -> list[str]:
    """The refusals of active.refusals (a source spec; column `refusal` unless `?column=` names another)."""
    spec = parse_source(cfg.active.refusals, "active.refusals")
    frame = read_source(spec, "active.refusals", holds="refusals")
    column = spec.column or REFUSAL_COLUMN
    if column not in frame.columns:
        raise DataError(
            f"active.refusals {cfg.active.refusals}: no column {column!r} (its columns: {list(frame.columns)}); name "
            "the column of the refusal texts with ?column=NAME"
        )
    refusals = [t for t in frame[column].astype(str) if t.strip()]
    if not refusals:
        raise DataError(f"active.refusals {cfg.active.refusals} holds no refusal text: give at least one")
    return refusals


def harden_passes(examples: list[SftExample], active: ActiveConfig, seed: tuple[Any, ...]) -> list[list[SftExample]]:
    """The examples of each pass of a hardening: active.harden_epochs whole passes, or with active.harden_steps as
    many whole passes as those steps hold and a last one of a seeded draw of the examples its remaining steps take.

    >>> from redteam_grpo.core.config import ActiveConfig
    >>> ten = [SftExample(str(i), [i], [i]) for i in range(10)]
    >>> [len(p) for p in harden_passes(ten, ActiveConfig(harden_steps=7, batch_size=4), (0,))]  # 3 steps a pass
    [10, 10, 4]
    >>> [len(p) for p in harden_passes(ten, ActiveConfig(harden_epochs=2, batch_size=4), (0,))]
    [10, 10]
    >>> [len(p) for p in harden_passes(ten[:3], ActiveConfig(harden_steps=3, batch_size=4), (0,))]  # 1 step a pass
    [3, 3, 3]
    >>> [len(p) for p in harden_passes(ten, ActiveConfig(harden_steps=2, batch_size=4), (0,))]  # less than a pass
    [8]
    >>> harden_passes([], ActiveConfig(harden_steps=2), (0,))  # nothing found: no pass
    []
    """
    if not examples:
        return []
    if active.harden_steps is None:
        return [examples] * active.harden_epochs
    per_pass = math.ceil(len(examples) / active.batch_size)
    whole, rest = divmod(active.harden_steps, per_pass)
    passes = [examples] * whole
    if rest:
        passes.append(random.Random(derive_seed(*seed, "last-pass")).sample(examples, rest * active.batch_size))
    return passes


def harden_victim(
    policy: Policy, found: list[tuple[str, str]], cfg: Config, seed: tuple[Any, ...]
) -> tuple[torch.optim.Optimizer, float, int, int]:
    """Safety-tune the victim, the active role's adapter as it stands, on `found` (id, attack text) pairs, each paired
    with a refusal of active.refusals drawn by `seed`: a fresh AdamW at active.learning_rate, the passes of
    `harden_passes` in active.batch_size attacks a step, loss on the refusal's tokens. The one recipe of the harden
    stage and of the evaluation's cross-attack table. Returns the optimizer, the last pass's loss, the tokens and the
    steps."""
    rng = random.Random(derive_seed(*seed))
    refusals = load_refusals(cfg)
    pairs = [(attack_id, text, rng.choice(refusals)) for attack_id, text in found]
    examples = sft_examples(policy, pairs, cfg.model.system_prompt)
    optimizer = make_optimizer(policy, cfg.training.model_copy(update={"learning_rate": cfg.active.learning_rate}))
    tokens = steps = 0
    loss = math.nan
    for epoch, examples_of_the_pass in enumerate(harden_passes(examples, cfg.active, seed)):
        stats = sft_epoch(
            policy,
            optimizer,
            examples_of_the_pass,
            [],
            cfg.active.batch_size,
            cfg.training.micro_batch_size,
            cfg.training.grad_clip,
            derive_seed(*seed, epoch),
        )
        tokens, steps, loss = tokens + stats.train_tokens, steps + stats.steps, stats.train_loss
    return optimizer, loss, tokens, steps  # the last pass's loss


@task(name=HARDEN.name, cache_policy=NO_CACHE)
def harden_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    run, cfg = res.run, res.config
    folder = run.checkpoint_dir(iteration)
    weights = [folder / checkpoints.ADAPTER_FILE, folder / checkpoints.OPTIMIZER_FILE]

    def compute() -> tuple[pa.Table, Any]:
        started = time.perf_counter()
        res.ensure_role(DEFAULT_ROLE, iteration - 1)  # the victim the iteration's responses came from
        hardened = cfg.active.hardens_after(iteration)
        found = found_attacks(run, iteration, cfg.active.harm_threshold) if hardened else []
        train_loss, tokens, steps = float("nan"), 0, 0
        with res.policy.role(DEFAULT_ROLE):
            if found:
                optimizer, train_loss, tokens, steps = harden_victim(
                    res.policy, found, cfg, (cfg.run.seed, "harden", iteration)
                )
                res.roles[DEFAULT_ROLE].optimizer = optimizer
            checkpoints.save_adapter(weights[0], res.policy.adapter_state(DEFAULT_ROLE))
            checkpoints.save_optimizer(weights[1], res.optimizer_for(DEFAULT_ROLE))
        res.holds(DEFAULT_ROLE, iteration)
        row = {
            "run_id": run.run_id,
            "iteration": iteration,
            "hardened": bool(found),
            "attacks_found": len(found) if hardened else None,
            "train_loss": train_loss,
            "train_tokens": tokens,
            "steps": steps,
            "seconds": time.perf_counter() - started,
        }
        return schemas.to_table({k: [v] for k, v in row.items()}, schemas.HARDEN_METRICS, "harden_metrics"), {}

    return run_table_stage(run, HARDEN, iteration, compute, also_written=weights)
