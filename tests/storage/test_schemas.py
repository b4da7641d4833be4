"""Strict schemas: a missing, renamed, mistyped or extra column is an error that names it."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from redteam_grpo.storage import schemas


def _advantages(**overrides):
    rows = {
        "run_id": ["r"],
        "iteration": [0],
        "prompt_id": ["p0"],
        "sample_idx": [0],
        "reward": [0.5],
        "advantage": [0.1],
        "turn_advantages": [None],
    }
    rows.update(overrides)
    return rows


def test_round_trip(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(schemas.to_table(_advantages(), schemas.ADVANTAGES, "advantages"), path)
    table = schemas.read_table(path, schemas.ADVANTAGES)
    assert table.to_pydict()["advantage"] == [0.1]


def test_renamed_column_is_named_not_silently_zero(tmp_path):
    # Bug class renamed-column-reads-as-zeros (docs/bug-classes.md): `log_probs` read, `old_log_probs` written.
    table = schemas.to_table(_advantages(), schemas.ADVANTAGES, "advantages").rename_columns(
        ["run_id", "iteration", "prompt_id", "sample_idx", "reward", "old_advantage", "turn_advantages"]
    )
    path = tmp_path / "a.parquet"
    pq.write_table(table, path)
    with pytest.raises(schemas.SchemaError, match=r"missing column 'advantage'.*unexpected column 'old_advantage'"):
        schemas.read_table(path, schemas.ADVANTAGES)


def test_mistyped_column_is_named(tmp_path):
    table = pa.table({**_advantages(), "advantage": ["0.1"]})
    path = tmp_path / "a.parquet"
    pq.write_table(table, path)
    with pytest.raises(schemas.SchemaError, match="column 'advantage' is string"):
        schemas.read_table(path, schemas.ADVANTAGES)


def test_writer_refuses_missing_and_extra_columns_and_nulls():
    rows = _advantages()
    del rows["advantage"]
    with pytest.raises(schemas.SchemaError, match=r"missing columns \['advantage'\]"):
        schemas.to_table(rows, schemas.ADVANTAGES, "advantages")
    with pytest.raises(schemas.SchemaError, match=r"unexpected columns \['extra'\]"):
        schemas.to_table(_advantages(extra=[1]), schemas.ADVANTAGES, "advantages")
    with pytest.raises(schemas.SchemaError, match="'advantage' has nulls"):
        schemas.to_table(_advantages(advantage=[None]), schemas.ADVANTAGES, "advantages")


def test_unreadable_file_says_how_to_recover(tmp_path):
    path = tmp_path / "a.parquet"
    path.write_bytes(b"PAR1 garbage")
    with pytest.raises(schemas.SchemaError, match="delete it to recompute"):
        schemas.read_table(path, schemas.ADVANTAGES)
    with pytest.raises(schemas.SchemaError, match="has not completed"):
        schemas.read_table(tmp_path / "missing.parquet", schemas.ADVANTAGES)


def test_list_columns_round_trip_with_their_types(tmp_path):
    rows = {name: [None] for name in schemas.ROLLOUTS.names}
    rows.update(
        run_id=["r"],
        iteration=[0],
        prompt_id=["p"],
        sample_idx=[0],
        prompt=["hi"],
        prompt_token_ids=[[1, 2]],
        completion_token_ids=[[3, 4]],
        sampling_logprobs=[[-0.5, -1.5]],
        completion_text=["x"],
        finish_reason=["stop"],
        completion_length=[2],
        policy_version=[-1],
        sampling_seed=[7],
        temperature=[1.0],
        turn=[0],
        speaker=["policy"],
    )
    path = tmp_path / "r.parquet"
    pq.write_table(schemas.to_table(rows, schemas.ROLLOUTS, "rollouts"), path)
    assert schemas.read_table(path, schemas.ROLLOUTS).to_pydict()["sampling_logprobs"] == [[-0.5, -1.5]]


def test_rows_become_a_table_of_their_schema_and_a_key_one_row_lacks_or_adds_is_named():
    rows = [{"policy": "base", "metric": "harm_mean", "tau": 0.5, "value": 0.25, "judge": None}] * 2
    assert schemas.rows_to_table(rows, schemas.EVALUATION_SUMMARY, "summary").num_rows == 2
    lacking = [rows[0], {k: v for k, v in rows[0].items() if k != "judge"}]  # a nullable column: never read as null
    with pytest.raises(schemas.SchemaError, match=r"row 1 lacks \['judge'\] and adds \[\]"):
        schemas.rows_to_table(lacking, schemas.EVALUATION_SUMMARY, "summary")
    with pytest.raises(schemas.SchemaError, match=r"unexpected columns \['extra'\]"):
        schemas.rows_to_table([{**r, "extra": 1} for r in rows], schemas.EVALUATION_SUMMARY, "summary")
