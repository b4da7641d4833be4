"""Read a run with SQL: DuckDB views over its Parquet files, a per-iteration summary, adversarial examples.

Views (one row per completion unless said otherwise), over every completed iteration, as declared in
storage/stages.py:

    rollouts    prompt/completion text and token ids, sampling logprobs, finish reason
    scores      harm, scorer, judge categories, refusal, novelty, repetition, KL to the base, reward
    advantages  reward, advantage
    metrics     one row per iteration: every metric of core/metrics/registry.py

Only files of stages the manifest records as completed are read, each checked against its recorded checksum and its
schema first, so a query never mixes a half-written, damaged or foreign file into its answer, nor leaves one out.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from redteam_grpo.core.metrics.registry import CHECK, SUMMARY, shown_in
from redteam_grpo.core.rollouts.dialogue import dialogue_messages
from redteam_grpo.storage import schemas
from redteam_grpo.storage.location import is_remote
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import RunDir, checkpoint_name
from redteam_grpo.storage.stages import BY_VIEW

SUMMARY_COLUMNS = [m.name for m in shown_in(SUMMARY)]
CHECK_COLUMNS = [m.name for m in shown_in(CHECK)]


def connect(run: RunDir) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the run's views (empty views for stages with no files yet)."""
    con = duckdb.connect()
    if is_remote(run.root):  # DuckDB reads the run's URLs through the same fsspec file system
        con.register_filesystem(run.root.fs)
    for view, stage in BY_VIEW.items():
        schema = stage.schema
        files = []
        for iteration in run.recorded_iterations(stage):
            run.verify(stage, iteration, weights=False)  # missing or changed: an error, never skipped
            for path in run.table_paths(stage, iteration):  # a sharded stage's parts are one table
                schemas.check_schema(schemas.read_schema(path), schema, str(path))
                files.append(path)
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


def metrics_view(run: RunDir) -> str:
    """The view of the run's per-iteration metrics rows: its mode's metrics stage's where that is a GRPO update's
    (Active Attacks: the attacker's, attack_metrics), else `metrics`."""
    stage = mode_of(run.stored_config()).metrics
    return stage.view if stage.schema is schemas.TRAIN_METRICS and stage.view else "metrics"


def summary(run: RunDir) -> pd.DataFrame:
    with connect(run) as con:
        return con.execute(f"select {', '.join(SUMMARY_COLUMNS)} from {metrics_view(run)} order by iteration").df()


def first_update_check(run: RunDir) -> pd.DataFrame:
    """Per iteration, each gate of the first-update check beside its bound (core/training/train.py)."""
    with connect(run) as con:
        return con.execute(f"select {', '.join(CHECK_COLUMNS)} from {metrics_view(run)} order by iteration").df()


def conversations(con: duckdb.DuckDBPyConnection, examples: pd.DataFrame) -> list[list[dict[str, str]]]:
    """Each example's dialogue as chat messages (user, assistant, ...): the prompt and the policy's answer, then each
    later turn's attacker message and answer; single-turn: the prompt and the completion. `con`: the run's views
    (`connect`)."""
    if examples.empty:
        return []
    turns = con.execute(
        "select iteration, prompt_id, sample_idx, turn, speaker, prompt, completion_text from rollouts "
        "where iteration in (select unnest(?))",
        [sorted({int(i) for i in examples["iteration"]})],
    ).df()
    by_iteration = {
        int(iteration): dialogue_messages(rows.to_dict("list")) for iteration, rows in turns.groupby("iteration")
    }
    return [by_iteration[int(e.iteration)][(e.prompt_id, int(e.sample_idx))] for e in examples.itertuples(index=False)]


def adversarial_examples(run: RunDir, min_score: float = 0.0, limit: int | None = None) -> pd.DataFrame:
    """Completions with harm >= min_score, best first, with lineage: run, iteration, the checkpoint whose
    weights sampled them, the base model, and the scorer and its revision."""
    config = run.stored_config()
    manifest = run.identity_and_status()
    with connect(run) as con:
        df = con.execute(
            """
            select r.run_id, r.iteration, r.prompt_id, r.sample_idx, r.prompt, r.completion_text as completion,
                   s.harm, s.turn_harm, s.reward, s.refusal, s.categories, s.novelty, r.finish_reason,
                   r.policy_version,
                   s.scorer_name, s.scorer_revision, s.scorer_kind
            from (
                select * from rollouts where speaker = 'policy'  -- a dialogue's last answer: the one scored
                qualify row_number() over (partition by run_id, iteration, prompt_id, sample_idx order by turn desc) = 1
            ) r join scores s using (run_id, iteration, prompt_id, sample_idx)
            where s.harm >= ?
            order by s.harm desc, r.iteration, r.prompt_id, r.sample_idx
            """
            + (f" limit {int(limit)}" if limit is not None else ""),
            [min_score],
        ).df()
        messages = conversations(con, df)
    df.insert(df.columns.get_loc("policy_version"), "checkpoint", df.pop("policy_version").map(checkpoint_name))
    df.insert(df.columns.get_loc("completion") + 1, "messages", messages)
    df["base_model"] = config.model.policy
    df["base_model_revision"] = config.model.revision
    df["lineage"] = manifest.get("lineage")
    df["parent_run"] = manifest.get("parent_run")
    return df
