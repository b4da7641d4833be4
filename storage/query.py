"""Read a run with SQL: DuckDB views over its Parquet files, a per-iteration summary, adversarial examples.

Views (one row per completion unless said otherwise), over every completed iteration:

    rollouts    prompt/completion text and token ids, sampling logprobs, finish reason
    scores      toxicity, scorer, judge categories, refusal, novelty, repetition, KL, reward
    advantages  reward, advantage
    metrics     one row per iteration: reward, toxicity, KL, ratio, entropy, lengths, refusals, novelty

Only files of stages the manifest records as completed are read, each checked against its schema first, so
a query never mixes a half-written or foreign file into its answer.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq

from redteam_grpo.storage import schemas
from redteam_grpo.storage.rundir import RunDir

VIEWS = {
    "rollouts": ("sample", schemas.ROLLOUTS),
    "scores": ("score", schemas.SCORES),
    "advantages": ("advantage", schemas.ADVANTAGES),
    "metrics": ("train_step", schemas.TRAIN_METRICS),
}

SUMMARY_COLUMNS = [
    "iteration",
    "reward_mean",
    "toxicity_mean",
    "repetition_mean",
    "kl_mean",
    "ratio_mean",
    "entropy",
    "length_mean",
    "refusal_rate",
    "novelty_mean",
]


def stage_files(run: RunDir, stage: str) -> list[Path]:
    """The files of `stage` for every iteration the manifest records as completed, in iteration order."""
    recorded = run.manifest()["stages"]
    iterations = sorted(int(key.split("/")[0]) for key in recorded if key.endswith(f"/{stage}"))
    return [run.stage_path(i, stage) for i in iterations if run.stage_path(i, stage).is_file()]


def connect(run: RunDir) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the run's views (empty views for stages with no files yet)."""
    con = duckdb.connect()
    for view, (stage, schema) in VIEWS.items():
        files = stage_files(run, stage)
        for path in files:
            schemas.check_schema(pq.read_schema(path), schema, str(path))
        if files:
            listed = ", ".join("'" + str(p).replace("'", "''") + "'" for p in files)
            con.execute(f"create view {view} as select * from read_parquet([{listed}])")
        else:
            con.register(f"_{view}_empty", schema.empty_table())
            con.execute(f"create view {view} as select * from _{view}_empty")
    return con


def query(run: RunDir, sql: str) -> pd.DataFrame:
    """Run `sql` over the run's views; a bad query is a `duckdb.Error` naming what is wrong."""
    with connect(run) as con:
        return con.execute(sql).df()


def summary(run: RunDir) -> pd.DataFrame:
    with connect(run) as con:
        return con.execute(f"select {', '.join(SUMMARY_COLUMNS)} from metrics order by iteration").df()


def adversarial_examples(run: RunDir, min_score: float = 0.0, limit: int | None = None) -> pd.DataFrame:
    """Completions with toxicity >= min_score, best first, with lineage: run, iteration, the checkpoint whose
    weights sampled them, the base model, and the scorer and its revision."""
    config = run.stored_config()
    manifest = run.manifest()
    with connect(run) as con:
        df = con.execute(
            """
            select r.run_id, r.iteration, r.prompt_id, r.sample_idx, r.prompt, r.completion_text as completion,
                   s.toxicity, s.reward, s.refusal, s.categories, s.novelty, r.finish_reason,
                   case when r.policy_version < 0 then 'init'
                        else printf('iter_%04d', r.policy_version) end as checkpoint,
                   s.scorer_name, s.scorer_revision, s.scorer_kind
            from rollouts r join scores s using (run_id, iteration, prompt_id, sample_idx)
            where s.toxicity >= ?
            order by s.toxicity desc, r.iteration, r.prompt_id, r.sample_idx
            """
            + (f" limit {int(limit)}" if limit is not None else ""),
            [min_score],
        ).df()
    df["base_model"] = config.model.policy
    df["base_model_revision"] = config.model.revision
    df["lineage"] = manifest.get("lineage")
    df["parent_run"] = manifest.get("parent_run")
    return df
