"""The stages of an iteration, declared once: name, file, schema, SQL view and what each holds.

Everything that touches a stage's output — the run directory, the manifest, the stage skeleton in `tasks/`,
DuckDB views, lineage, export, reports, artifacts — looks it up here, so a stage cannot have one name in the
manifest, another on disk and a third in SQL. A mode of the pipeline is a list of these records: an attack
iteration is `ATTACK_ITERATION`; another mode composes the same records with other models and scorers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from redteam_grpo.storage import schemas


@dataclass(frozen=True)
class Stage:
    name: str  # the manifest's and Prefect's name of the stage
    file: str | None  # its Parquet file inside the iteration folder (None: writes checkpoint files only)
    schema: pa.Schema | None
    view: str | None  # the DuckDB view over every completed iteration's file
    description: str

    @property
    def label(self) -> str:
        return self.file or self.name


SAMPLE = Stage(
    "sample",
    "rollouts.parquet",
    schemas.ROLLOUTS,
    "rollouts",
    "G completions per prompt: prompt ids as fed, completion ids as drawn, one sampling logprob per token",
)
SCORE = Stage(
    "score",
    "scores.parquet",
    schemas.SCORES,
    "scores",
    "harm score, judge categories, refusal, novelty, repetition, KL to the base, and the composite reward",
)
ADVANTAGE = Stage(
    "advantage", "advantages.parquet", schemas.ADVANTAGES, "advantages", "group-relative advantage of every completion"
)
TRAIN_STEP = Stage(
    "train_step",
    "train_metrics.parquet",
    schemas.TRAIN_METRICS,
    "metrics",
    "one row per iteration: every metric of core/metrics.py; the updated adapter and optimizer go to the checkpoint",
)
CHECKPOINT = Stage(
    "checkpoint", None, None, None, "seals the iteration's checkpoint: RNG state, then its manifest, written last"
)

ATTACK_ITERATION: tuple[Stage, ...] = (SAMPLE, SCORE, ADVANTAGE, TRAIN_STEP, CHECKPOINT)
TABLE_STAGES: tuple[Stage, ...] = tuple(s for s in ATTACK_ITERATION if s.file is not None)
BY_NAME: dict[str, Stage] = {s.name: s for s in ATTACK_ITERATION}
BY_VIEW: dict[str, Stage] = {s.view: s for s in TABLE_STAGES if s.view}
