"""Each stage called directly (`task.fn()`) on temporary run directories: the output of every stage is read back
by the next stage's reader, and the stage-level guarantees hold."""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.core.scoring.scorers import ScorerError
from redteam_grpo.core.training.kl import policy_reference_logprobs
from redteam_grpo.core.training.staleness import StaleRolloutsError
from redteam_grpo.storage import schemas
from redteam_grpo.storage.rundir import DamagedRunError, RunDir
from redteam_grpo.storage.stages import ADVANTAGE, CHECKPOINT, JUDGE, SAMPLE, SCORE, TRAIN_STEP
from redteam_grpo.tasks import resources
from redteam_grpo.tasks.advantage import advantage_stage
from redteam_grpo.tasks.checkpoint import checkpoint_stage, initialize_stage
from redteam_grpo.tasks.judge import judge_stage
from redteam_grpo.tasks.sample import sample_stage
from redteam_grpo.tasks.score import score_stage
from redteam_grpo.tasks.train_step import JoinError, recorded_stats, train_step_stage

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")


@pytest.fixture
def run(tmp_path):
    cfg = load_config(
        None,
        [
            f"run.runs_dir={tmp_path}",
            "run.run_id=t",
            "data.prompts_per_iteration=2",
            "sampling.group_size=3",
            "sampling.max_new_tokens=8",
        ],
    )
    run = RunDir.create(cfg)
    yield run
    resources.forget(run.root)


def _write(run, iteration, stage, table, stats=None):
    """Put a table in place by hand, whatever its schema, and record it as the stage's output."""
    path = run.path(stage, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    run.record_done(stage, iteration, [path], stats=stats or {})


def test_every_stage_output_is_read_back_by_the_next_stage(run):
    root = str(run.root)
    initialize_stage.fn(root)
    paths = {
        "sample": sample_stage(root, 0),
        "judge": judge_stage(root, 0),
        "score": score_stage(root, 0),
        "advantage": advantage_stage.fn(root, 0),
        "train_step": train_step_stage.fn(root, 0),
    }
    checkpoint_stage.fn(root, 0)
    stages = {"sample": SAMPLE, "judge": JUDGE, "score": SCORE, "advantage": ADVANTAGE, "train_step": TRAIN_STEP}
    tables = {name: run.read(stage, 0).to_pydict() for name, stage in stages.items()}
    assert all(str(run.path(stages[s], 0)) == p for s, p in paths.items())
    keys = {
        s: list(zip(tables[s]["prompt_id"], tables[s]["sample_idx"], strict=True))
        for s in ("sample", "judge", "score", "advantage")
    }
    assert keys["sample"] == keys["judge"] == keys["score"] == keys["advantage"] and len(set(keys["sample"])) == 6
    # the score stage copies what the judge read, and adds what needs the policy
    assert all(tables["score"][c] == tables["judge"][c] for c in schemas.JUDGEMENTS.names)
    assert tables["score"]["reward"] == tables["advantage"]["reward"]
    assert [len(x) for x in tables["score"]["reference_logprobs"]] == tables["sample"]["completion_length"]
    # iteration 0: LoRA's B is 0, the policy is the base, and both sides of the KL come from the same forward
    assert tables["score"]["kl"] == [0.0] * 6
    assert tables["train_step"]["iteration"] == [0]
    assert run.completed(CHECKPOINT, 0)


def _rollouts(run, prompt_ids, completions, tokenizer, sampling_logprobs=None):
    n = len(completions)
    return schemas.to_table(
        {
            "run_id": ["t"] * n,
            "iteration": [0] * n,
            "prompt_id": ["p0"] * n,
            "sample_idx": list(range(n)),
            "prompt": ["x"] * n,
            "prompt_token_ids": [prompt_ids] * n,
            "completion_token_ids": completions,
            "sampling_logprobs": sampling_logprobs or [[-1.0] * len(c) for c in completions],
            "completion_text": tokenizer.batch_decode(completions, skip_special_tokens=True),
            "finish_reason": ["length"] * n,
            "completion_length": [len(c) for c in completions],
            "policy_version": [-1] * n,
            "sampling_seed": [0] * n,
            "temperature": [1.0] * n,
            "turn": [0] * n,
            "speaker": ["policy"] * n,
        },
        schemas.ROLLOUTS,
        "rollouts",
    )


def test_repetition_is_measured_on_completion_tokens_only(run):
    # Bug class repetition-counts-prompt (docs/bug-classes.md). The prompt is one token repeated 30 times.
    initialize_stage.fn(str(run.root))
    res = resources.resources_for(run.root)
    tok = res.policy.tokenizer
    word = tok("the", add_special_tokens=False)["input_ids"]
    prompt_ids = word * 30
    completions = [tok(t, add_special_tokens=False)["input_ids"] for t in ("a b c d", "one two three", "x y z w v")]
    # the score stage takes the KL's policy side from the sampler's logprobs: give it the policy's own
    policy_lp, _, _ = policy_reference_logprobs(res.policy, [prompt_ids] * 3, completions)
    logprobs = [policy_lp[b, : len(c)].tolist() for b, c in enumerate(completions)]
    _write(run, 0, SAMPLE, _rollouts(run, prompt_ids, completions, tok, logprobs))
    judge_stage(str(run.root), 0)
    score_stage(str(run.root), 0)
    scores = schemas.read_table(run.path(SCORE, 0), schemas.SCORES).to_pydict()
    assert scores["repetition_ratio"] == [0.0, 0.0, 0.0]
    assert scores["kl"] == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)  # the initial adapter is the base


def test_a_completion_longer_than_the_classifier_is_scored_and_counted(run):
    # Bug class scorer-input-not-truncated (docs/bug-classes.md): the embedded classifier reads 128 tokens.
    initialize_stage.fn(str(run.root))
    tok = resources.resources_for(run.root).policy.tokenizer
    long = tok(" ".join(["the cat sat on the mat."] * 60), add_special_tokens=False)["input_ids"]
    completions = [long, tok("a b c d", add_special_tokens=False)["input_ids"], long[:20]]
    assert len(long) > 128
    _write(run, 0, SAMPLE, _rollouts(run, tok("x", add_special_tokens=False)["input_ids"], completions, tok))
    judge_stage(str(run.root), 0)
    score_stage(str(run.root), 0)
    scores = schemas.read_table(run.path(SCORE, 0), schemas.SCORES).to_pydict()
    assert all(t is not None and 0.0 <= t <= 1.0 for t in scores["harm"])
    assert recorded_stats(run, SCORE, 0)["n_truncated_texts"] == 1


def test_a_missing_score_gives_advantage_zero_and_is_counted(run, monkeypatch):
    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    res = resources.resources_for(run.root)
    real = res.scoring.score

    def one_missing(completions, prompts, goals=None):
        scores = real(completions, prompts, goals)
        scores[1] = dataclasses.replace(scores[1], score=None)
        scores[4] = dataclasses.replace(scores[4], score=float("nan"))
        return scores

    monkeypatch.setattr(res.scoring, "score", one_missing)
    # 2 of 6 unscored: above the default bound (0.25), the stage stops, names the scorer and writes nothing
    with pytest.raises(ScorerError, match=r"33% of 6 completions got no score from embedded:tiny-toxicity.*0\.25"):
        judge_stage(root, 0)
    assert not run.completed(JUDGE, 0) and not run.path(JUDGE, 0).exists()
    monkeypatch.setattr(res.config.reward, "max_unscored_share", 0.5)  # a share the user expects
    judge_stage(root, 0)
    score_stage(root, 0)
    assert recorded_stats(run, SCORE, 0)["unscored_share"] == pytest.approx(2 / 6)
    advantage_stage.fn(root, 0)
    adv = schemas.read_table(run.path(ADVANTAGE, 0), schemas.ADVANTAGES).to_pydict()
    assert adv["reward"][1] is None and adv["reward"][4] is None
    assert adv["advantage"][1] == 0.0 and adv["advantage"][4] == 0.0
    assert all(math.isfinite(a) for a in adv["advantage"])
    train_step_stage.fn(root, 0)
    metrics = schemas.read_table(run.path(TRAIN_STEP, 0), schemas.TRAIN_METRICS).to_pylist()[0]
    assert metrics["n_invalid_rewards"] == 2


def test_train_step_refuses_rows_that_do_not_join_one_to_one(run):
    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    judge_stage(root, 0)
    score_stage(root, 0)
    advantage_stage.fn(root, 0)
    table = pq.read_table(run.path(ADVANTAGE, 0))
    _write(run, 0, ADVANTAGE, table.slice(0, table.num_rows - 1))  # one advantage lost
    with pytest.raises(JoinError, match="unmatched keys"):
        train_step_stage.fn(root, 0)


def _iterate(root, iteration):
    sample_stage(root, iteration)
    judge_stage(root, iteration)
    score_stage(root, iteration)
    advantage_stage.fn(root, iteration)
    train_step_stage.fn(root, iteration)
    checkpoint_stage.fn(root, iteration)


def test_each_row_records_the_weights_that_drew_it_as_held_and_an_update_trains_on_those_alone(run):
    # Bug classes stale-rollouts-trained-on and rollouts-drawn-by-another-version (docs/bug-classes.md).
    root = str(run.root)
    initialize_stage.fn(root)
    _iterate(root, 0)
    sample_stage(root, 1)
    versions = run.read(SAMPLE, 1).column("policy_version").to_pylist()
    assert versions == [0] * 6  # drawn by the weights after iteration 0's update, which iteration 1 trains from
    judge_stage(root, 1)
    score_stage(root, 1)
    advantage_stage.fn(root, 1)
    # the same rows, as if the weights before iteration 0's update had drawn them: refused, whatever they hold
    table, stats = pq.read_table(run.path(SAMPLE, 1)), recorded_stats(run, SAMPLE, 1)
    stale = table.set_column(
        table.schema.get_field_index("policy_version"), "policy_version", pa.array([-1] * 6, pa.int32())
    )
    _write(run, 1, SAMPLE, stale, stats)
    with pytest.raises(StaleRolloutsError, match=r"version\(s\) \[-1\].*by version 0 alone.*--redo 1"):
        train_step_stage.fn(root, 1)
    _write(run, 1, SAMPLE, table, stats)
    train_step_stage.fn(root, 1)  # the rows as drawn train


def test_a_renamed_column_between_stages_is_an_error_not_zeros(run):
    # Bug class renamed-column-reads-as-zeros (docs/bug-classes.md): old logprobs read under another name.
    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    table = pq.read_table(run.path(SAMPLE, 0))
    renamed = ["old_log_probs" if n == "sampling_logprobs" else n for n in table.column_names]
    _write(run, 0, SAMPLE, table.rename_columns(renamed))
    with pytest.raises(
        schemas.SchemaError, match=r"missing column 'sampling_logprobs'.*unexpected column 'old_log_probs'"
    ):
        judge_stage(root, 0)


def test_the_score_stage_refuses_judgements_of_other_rows(run):
    # Bug class judgements-of-other-rows (docs/bug-classes.md): the judge's scores, in another order, would pair each
    # completion with another's harm and train the update on it.
    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    judge_stage(root, 0)
    table = pq.read_table(run.path(JUDGE, 0))
    assert len(set(table.column("harm").to_pylist())) > 1  # a reordering changes which completion gets which score
    _write(run, 0, JUDGE, table.take(list(reversed(range(table.num_rows)))))
    with pytest.raises(DamagedRunError, match=r"judgements of shard 0 of iteration 0 are not of its.*redo 0/judge"):
        score_stage(root, 0)
    assert not run.completed(SCORE, 0)
    _write(run, 0, JUDGE, table)
    score_stage(root, 0)
    assert run.read(SCORE, 0).column("harm").to_pylist() == table.column("harm").to_pylist()


def test_a_group_with_a_missing_sample_is_refused(run):
    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    judge_stage(root, 0)
    score_stage(root, 0)
    table = pq.read_table(run.path(SCORE, 0))
    _write(run, 0, SCORE, table.slice(1))
    with pytest.raises(ValueError, match=r"expected 0\.\.2"):
        advantage_stage.fn(root, 0)


def test_weights_whose_checkpoint_is_damaged_are_refused_when_loaded(run):
    from redteam_grpo.storage import checkpoints
    from redteam_grpo.storage.rundir import DamagedRunError

    root = str(run.root)
    initialize_stage.fn(root)
    sample_stage(root, 0)
    judge_stage(root, 0)
    score_stage(root, 0)
    for stage in (advantage_stage, train_step_stage, checkpoint_stage):
        stage.fn(root, 0)
    adapter = run.checkpoint_dir(0) / checkpoints.ADAPTER_FILE
    flipped = bytearray(adapter.read_bytes())
    flipped[-16] ^= 0xFF
    adapter.write_bytes(bytes(flipped))
    resources.forget(run.root)  # a new process: the weights come from disk
    with pytest.raises(DamagedRunError, match=r"--redo 0/train_step"):
        resources.resources_for(run.root).ensure_version(0)
