"""An evaluation's finished parts (storage/evaluation_parts.py): read back under the same settings, discarded under
others, recomputed when damaged, and named so that no part leaves its folder."""

from __future__ import annotations

import pyarrow as pa

from redteam_grpo.storage.evaluation_parts import EvaluationParts, part_file_name

SCHEMA = pa.schema([pa.field("prompt_id", pa.string(), nullable=False), pa.field("harm", pa.float64())])


def _rows(calls: list[str], name: str, harm: float | None = 0.5):
    def compute():
        calls.append(name)
        return [{"prompt_id": "g1#0", "harm": harm}, {"prompt_id": "g2#0", "harm": None}]

    return compute


def test_a_part_finished_before_is_read_back_not_computed_and_equals_a_fresh_one(tmp_path):
    rows_path = tmp_path / "eval" / "iter_0003-active.parquet"
    calls: list[str] = []
    first = EvaluationParts(rows_path, {"seed": 0})
    fresh = first.rows("base.benign", SCHEMA, _rows(calls, "base.benign"))
    again = EvaluationParts(rows_path, {"seed": 0})  # the rerun of an interrupted evaluation
    assert again.rows("base.benign", SCHEMA, _rows(calls, "again")) == fresh
    assert calls == ["base.benign"] and again.resumed == ["base.benign"] and not again.discarded
    again.finish()
    assert not (tmp_path / "eval" / "iter_0003-active.parts").exists()


def test_parts_of_other_settings_are_discarded_first(tmp_path):
    rows_path = tmp_path / "run.parquet"
    calls: list[str] = []
    EvaluationParts(rows_path, {"seed": 0, "checkpoints": {"iter_0003": "a"}}).rows("p", SCHEMA, _rows(calls, "a", 0.1))
    # the checkpoint was rewritten since (`--redo`): its digest differs, and the part is sampled again
    rerun = EvaluationParts(rows_path, {"seed": 0, "checkpoints": {"iter_0003": "b"}})
    assert rerun.discarded
    assert rerun.rows("p", SCHEMA, _rows(calls, "b", 0.9))[0]["harm"] == 0.9 and calls == ["a", "b"]


def test_a_damaged_part_is_computed_again(tmp_path):
    rows_path = tmp_path / "run.parquet"
    calls: list[str] = []
    parts = EvaluationParts(rows_path, {})
    parts.rows("p", SCHEMA, _rows(calls, "first"))
    (parts.folder / "p.parquet").write_bytes(b"not parquet")
    assert EvaluationParts(rows_path, {}).rows("p", SCHEMA, _rows(calls, "second"))[0]["harm"] == 0.5
    assert calls == ["first", "second"]


def test_a_part_name_never_leaves_the_folder():
    assert part_file_name("round1.benign") == "round1.benign.parquet"
    for name in ("Qwen/Qwen3-4B.transfer", "../../outside", "a/../../b", ".."):
        file_name = part_file_name(name)
        assert "/" not in file_name and not file_name.startswith("."), file_name
    assert part_file_name("a/b") != part_file_name("a_b")  # a digest keeps two names apart


def test_the_settings_see_a_prompt_set_edited_under_the_same_name_and_ignore_what_parts_never_read():
    """tasks/evaluate.py: part_settings: the same options over other prompts (a goals file edited, prompts the run
    sampled since) are other settings; a transfer target or a flag's limit, read after the parts, are not."""
    from redteam_grpo.core.data.sources import Prompt
    from redteam_grpo.core.evaluation import EvaluationOptions
    from redteam_grpo.tasks.evaluate import part_settings

    goals = [Prompt("g1", "insult my coworker"), Prompt("g2", "mock my neighbour")]
    edited = [goals[0], Prompt("g2", "mock my landlord")]
    options = EvaluationOptions()
    settings = part_settings(options, 3, None, [], {"heldout_goals": goals})
    assert part_settings(options, 3, None, [], {"heldout_goals": edited}) != settings
    assert part_settings(options, 4, None, [], {"heldout_goals": goals}) != settings  # another checkpoint
    later = options.model_copy(update={"transfer_to": ["embedded:tiny-qwen3"], "over_refusal_margin": 0.5})
    assert part_settings(later, 3, None, [], {"heldout_goals": goals}) == settings
    assert part_settings(options.model_copy(update={"iteration": 3}), 3, None, [], {"heldout_goals": goals}) == settings
