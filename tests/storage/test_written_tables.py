"""The tables a process wrote are read back from memory only while the file on disk is still the one it wrote."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.storage import schemas
from redteam_grpo.storage.rundir import WRITTEN_TABLES, DamagedRunError, RunDir, WrittenTables
from redteam_grpo.storage.stages import ADVANTAGE


def _advantages(reward: float, rows: int = 1) -> pa.Table:
    return schemas.to_table(
        {
            "run_id": ["r"] * rows,
            "iteration": [0] * rows,
            "prompt_id": ["p"] * rows,
            "sample_idx": list(range(rows)),
            "reward": [reward] * rows,
            "advantage": [0.0] * rows,
            "turn_advantages": [None] * rows,
        },
        schemas.ADVANTAGES,
        "advantages",
    )


@pytest.fixture
def run(tmp_path):
    WRITTEN_TABLES.clear()
    yield RunDir.create(load_config(None, [f"run.runs_dir={tmp_path}", "run.run_id=r"]))
    WRITTEN_TABLES.clear()


def test_a_table_written_here_is_read_back_from_memory(run):
    table = _advantages(0.5)
    run.record_done(ADVANTAGE, 0, [run.write(ADVANTAGE, 0, table)])
    assert run.read(ADVANTAGE, 0) is table


def test_a_file_replaced_by_another_writer_is_read_from_disk_not_from_memory(run):
    """Another process (a later resume, `--redo`) writes the stage again and records it: this process must read the
    new file, though it holds the table it wrote under the same name. Same size, same schema: only the value differs."""
    path = run.write(ADVANTAGE, 0, _advantages(0.5))
    written_size = path.stat().st_size
    elsewhere = path.with_name("elsewhere.parquet")
    pq.write_table(_advantages(0.25), elsewhere)
    assert elsewhere.stat().st_size == written_size
    os.replace(elsewhere, path)
    run.record_done(ADVANTAGE, 0, [path])
    assert run.read(ADVANTAGE, 0).column("reward").to_pylist() == [0.25]


def test_a_file_damaged_after_it_was_recorded_is_refused_though_its_table_is_in_memory(run):
    path = run.write(ADVANTAGE, 0, _advantages(0.5))
    run.record_done(ADVANTAGE, 0, [path])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedRunError, match=r"advantages\.parquet"):
        run.read(ADVANTAGE, 0)


@pytest.mark.parametrize("bound", ["bytes", "tables"])
def test_the_oldest_tables_are_dropped_beyond_either_bound_and_a_larger_one_is_never_kept(tmp_path, bound):
    small, large = _advantages(0.5), _advantages(0.5, rows=400)
    tables = WrittenTables(max_bytes=2 * small.nbytes, max_tables=10) if bound == "bytes" else WrittenTables(2**30, 2)
    paths = [tmp_path / f"{k}.parquet" for k in range(3)]
    for path in [*paths, paths[1]]:  # the second written again: kept once, as the newest
        pq.write_table(small, path)
        tables.put(path, small)
    assert [tables.read(p, schemas.ADVANTAGES) is small for p in paths] == [False, True, True]
    tables.put(paths[0], small)  # the oldest now is the third
    assert [tables.read(p, schemas.ADVANTAGES) is small for p in paths] == [True, True, False]
    if bound == "bytes":
        pq.write_table(large, paths[0])
        tables.put(paths[0], large)
        assert tables.read(paths[0], schemas.ADVANTAGES) is not large
        assert tables.read(paths[0], schemas.ADVANTAGES).num_rows == 400
