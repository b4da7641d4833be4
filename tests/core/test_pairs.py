import json
import logging

import pandas as pd
import pytest

from redteam_grpo.core.data.pairs import Pair, load_pairs, pair_hash_id, split_pairs
from redteam_grpo.core.data.sources import DataError

ROWS = [
    {"goal": "g1", "prompt": "p1", "pid": 10},
    {"goal": "g2", "prompt": "p2", "pid": 11},
    {"goal": "g1", "prompt": "p1", "pid": 12},  # exact duplicate of the first pair: dropped
    {"goal": "g1", "prompt": "p1 again", "pid": 13},  # same goal, another target: a pair of its own
    {"goal": "", "prompt": "p3", "pid": 14},  # empty input: skipped
    {"goal": "g4", "prompt": "   ", "pid": 15},  # blank target: skipped
    {"goal": "g5", "prompt": None, "pid": 16},  # missing target: skipped
]
EXPECTED = [("g1", "p1"), ("g2", "p2"), ("g1", "p1 again")]


def write(path, rows) -> None:
    frame = pd.DataFrame(rows)
    if path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_local_format_gives_the_same_pairs_with_hashed_ids(tmp_path, suffix):
    path = tmp_path / f"pairs{suffix}"
    write(path, ROWS)
    pairs = load_pairs(str(path))
    assert [(p.input_text, p.target_text) for p in pairs] == EXPECTED
    assert [p.pair_id for p in pairs] == [pair_hash_id(i, t) for i, t in EXPECTED]
    assert len({p.pair_id for p in pairs}) == len(pairs)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_ids_come_from_the_id_column_as_written(tmp_path, suffix):
    path = tmp_path / f"pairs{suffix}"
    write(path, ROWS)
    pairs = load_pairs(str(path), id_column="pid")
    assert [p.pair_id for p in pairs] == ["10", "11", "13"]


def test_integer_ids_with_a_gap_are_not_written_as_floats(tmp_path):
    path = tmp_path / "pairs.csv"
    write(path, [{"goal": "a", "prompt": "x", "pid": 7}, {"goal": "b", "prompt": "y", "pid": None}])
    pairs = load_pairs(str(path), id_column="pid")  # pandas reads the column as float: 7.0, NaN
    assert pairs == [Pair("7", "a", "x")]  # the row without an id is skipped


def test_hashed_ids_are_stable_and_depend_on_both_texts():
    assert pair_hash_id("a", "b") == pair_hash_id("a", "b")
    assert pair_hash_id("a", "b") != pair_hash_id("b", "a")
    assert pair_hash_id("a b", "c") != pair_hash_id("a", "b c")  # the boundary between the texts counts


def test_configurable_columns_and_max_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    write(path, [{"behavior": f"b{i}", "attack": f"a{i}"} for i in range(5)])
    pairs = load_pairs(str(path), input_column="behavior", target_column="attack", max_pairs=2)
    assert [(p.input_text, p.target_text) for p in pairs] == [("b0", "a0"), ("b1", "a1")]


def test_skipped_rows_are_counted_in_a_warning(tmp_path, caplog):
    path = tmp_path / "pairs.jsonl"
    write(path, ROWS)
    with caplog.at_level(logging.WARNING, logger="redteam_grpo.core.data.pairs"):
        load_pairs(str(path))
    assert "skipped 3 rows" in caplog.text


@pytest.mark.parametrize(
    ("argument", "setting"),
    [("input_column", "data.prompt_column"), ("target_column", "sft.target_column"), ("id_column", "data.id_column")],
)
def test_a_missing_column_names_the_setting_and_the_columns_there_are(tmp_path, argument, setting):
    path = tmp_path / "pairs.jsonl"
    write(path, [{"goal": "g", "prompt": "p"}])
    with pytest.raises(DataError, match=rf"{setting} 'nope' is not a column .* \['goal', 'prompt'\]: set {setting}"):
        load_pairs(str(path), **{argument: "nope"})


def test_errors_name_the_caller_s_settings(tmp_path):
    path = tmp_path / "pairs.jsonl"
    write(path, [{"goal": "g", "prompt": "p"}])
    with pytest.raises(DataError, match=r"^attacker.goal_column 'nope' is not a column"):
        load_pairs(str(path), input_column="nope", setting_names={"input_column": "attacker.goal_column"})
    with pytest.raises(DataError, match=r"^data.max_prompts is 0: use a positive number"):
        load_pairs(str(path), max_pairs=0)


def test_an_empty_file_and_a_file_without_usable_rows_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"data.source .* is empty: it holds no pairs"):
        load_pairs(str(empty))
    unusable = tmp_path / "unusable.csv"
    write(unusable, [{"goal": "", "prompt": "p"}, {"goal": "g", "prompt": None}])
    with pytest.raises(DataError, match="holds no usable pairs: every one of its 2 rows"):
        load_pairs(str(unusable))


def test_a_repeated_id_for_different_pairs_is_refused(tmp_path):
    path = tmp_path / "pairs.jsonl"
    write(path, [{"goal": "a", "prompt": "x", "pid": 1}, {"goal": "b", "prompt": "y", "pid": 1}])
    with pytest.raises(DataError, match=r"gives id '1' to two different pairs.*set data.id_column=null"):
        load_pairs(str(path), id_column="pid")


def test_a_missing_local_file_is_not_mistaken_for_a_hub_dataset(tmp_path):
    with pytest.raises(DataError, match=r"data.source .* does not exist"):
        load_pairs(str(tmp_path / "nope.parquet"))


def test_bundled_reads_the_bundled_attacker_pairs_and_names_the_bundled_files():
    pairs = load_pairs("bundled", id_column="pair_id")
    assert pairs == load_pairs("bundled:attack_pairs.jsonl", id_column="pair_id")
    assert len(pairs) > 100 and all(p.pair_id.startswith("a") and "my " in p.target_text for p in pairs)
    with pytest.raises(DataError, match=r"no such bundled file; bundled files: .*bundled:attack_pairs.jsonl"):
        load_pairs("bundled:nope.jsonl")


def test_a_hub_dataset_is_loaded_by_name_and_split(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"goal": "g", "prompt": "p"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_pairs("org/redteam-pairs", split="test") == [Pair(pair_hash_id("g", "p"), "g", "p")]
    assert calls == [("org/redteam-pairs", "test")]


def make_pairs(n: int) -> list[Pair]:
    return [Pair(f"id{i}", f"goal {i}", f"prompt {i}") for i in range(n)]


def test_split_is_seeded_disjoint_complete_and_in_source_order():
    pairs = make_pairs(50)
    train, held_out = split_pairs(pairs, 0.2, seed=3)
    assert len(held_out) == 10 and len(train) == 40
    assert {p.pair_id for p in train}.isdisjoint(p.pair_id for p in held_out)
    assert sorted(train + held_out, key=pairs.index) == pairs
    assert train == sorted(train, key=pairs.index) and held_out == sorted(held_out, key=pairs.index)
    assert split_pairs(pairs, 0.2, seed=3) == (train, held_out)
    assert split_pairs(pairs, 0.2, seed=4)[1] != held_out


def test_split_does_not_depend_on_the_order_of_the_pairs():
    pairs = make_pairs(30)
    _, held_out = split_pairs(pairs, 0.3, seed=1)
    _, held_out_reversed = split_pairs(pairs[::-1], 0.3, seed=1)
    assert {p.pair_id for p in held_out} == {p.pair_id for p in held_out_reversed}


def test_split_holds_out_at_least_one_pair_and_keeps_at_least_one_to_train():
    assert [len(part) for part in split_pairs(make_pairs(2), 0.01, seed=0)] == [1, 1]
    assert [len(part) for part in split_pairs(make_pairs(3), 0.99, seed=0)] == [1, 2]
    assert split_pairs(make_pairs(3), 0.0, seed=0) == (make_pairs(3), [])
    assert split_pairs(make_pairs(1), 0.0, seed=0) == (make_pairs(1), [])


def test_split_refuses_too_few_pairs_a_bad_fraction_and_repeated_ids():
    with pytest.raises(DataError, match=r"only 1: a split needs at least 2.*eval_fraction=0"):
        split_pairs(make_pairs(1), 0.1, seed=0)
    for fraction in (-0.1, 1.0, float("nan")):
        with pytest.raises(DataError, match=r"use a fraction in \[0, 1\)"):
            split_pairs(make_pairs(4), fraction, seed=0)
    with pytest.raises(DataError, match="pair ids repeat"):
        split_pairs([*make_pairs(2), make_pairs(1)[0]], 0.5, seed=0)
