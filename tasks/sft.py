"""SFT stage: one epoch of supervised fine-tuning of the adapter on (input → target) pairs, then the held-out
loss; writes the adapter and optimizer into the epoch's checkpoint folder, like a GRPO train step, so an SFT
attacker is a checkpoint any run can start from (defense.attacker)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.config import Config
from redteam_grpo.core.data.pairs import Pair, load_pairs, split_pairs
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.core.training.sft import sft_epoch, sft_examples
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.stages import SFT_TRAIN
from redteam_grpo.tasks.common import run_table_stage
from redteam_grpo.tasks.resources import resources_for


def training_pairs(cfg: Config) -> list[Pair]:
    """The SFT pairs of data.source: data.prompt_column is the input, sft.target_column the target."""
    return load_pairs(
        cfg.data.source,
        cfg.data.split,
        cfg.data.prompt_column,
        cfg.sft.target_column,
        cfg.data.id_column,
        cfg.data.max_prompts,
        subset=cfg.data.subset,
    )


@task(name=SFT_TRAIN.name, cache_policy=NO_CACHE)
def sft_train_stage(run_dir: str, iteration: int) -> str:
    res = resources_for(run_dir)
    run, cfg = res.run, res.config
    folder = run.checkpoint_dir(iteration)
    weights = [folder / checkpoints.ADAPTER_FILE, folder / checkpoints.OPTIMIZER_FILE]

    def compute() -> tuple[pa.Table, Any]:
        started = time.perf_counter()
        train, held_out = split_pairs(training_pairs(cfg), cfg.sft.eval_fraction, cfg.run.seed)
        as_examples = lambda pairs: sft_examples(  # noqa: E731
            res.policy, [(p.pair_id, p.input_text, p.target_text) for p in pairs], cfg.model.system_prompt
        )
        res.ensure_version(iteration - 1)
        stats = sft_epoch(
            res.policy,
            res.optimizer_for(DEFAULT_ROLE),
            as_examples(train),
            as_examples(held_out),
            cfg.sft.batch_size,
            cfg.training.micro_batch_size,
            cfg.training.grad_clip,
            derive_seed(cfg.run.seed, "sft", iteration),
        )
        checkpoints.save_adapter(weights[0], res.policy.adapter_state())
        checkpoints.save_optimizer(weights[1], res.optimizer_for(DEFAULT_ROLE))
        res.holds(DEFAULT_ROLE, iteration)
        row = {**dataclasses.asdict(stats), "seconds": time.perf_counter() - started}
        table = schemas.to_table(
            {"run_id": [run.run_id], "iteration": [iteration], **{k: [v] for k, v in row.items()}},
            schemas.SFT_METRICS,
            "sft_metrics",
        )
        return table, {}

    return run_table_stage(run, SFT_TRAIN, iteration, compute, also_written=weights)
