import json

import pyarrow as pa
import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.storage import schemas
from redteam_grpo.storage.rundir import RunDir, RunDirError, checkpoint_name
from redteam_grpo.storage.stages import ADVANTAGE, ALL_STAGES, BY_VIEW, SCORE


@pytest.fixture(params=["local", "object-store"])
def run(request, tmp_path):
    """A run in a local folder, and the same in an in-memory object store (the fsspec code path of s3:// URLs)."""
    runs_dir = tmp_path if request.param == "local" else request.getfixturevalue("memory_store") + "/runs"
    return RunDir.create(load_config(None, [f"run.runs_dir={runs_dir}", "run.run_id=r"]))


def _advantages(iteration: int) -> pa.Table:
    return schemas.to_table(
        {
            "run_id": ["r"],
            "iteration": [iteration],
            "prompt_id": ["p"],
            "sample_idx": [0],
            "reward": [0.5],
            "advantage": [0.0],
            "turn_advantages": [None],
        },
        schemas.ADVANTAGES,
        "advantages",
    )


def test_every_stage_is_declared_once_with_its_file_schema_and_view():
    assert sorted(BY_VIEW) == [
        "advantages",
        "attack_advantages",
        "attack_metrics",
        "attack_scores",
        "attacks",
        "harden_metrics",
        "judgements",
        "metrics",
        "rollouts",
        "scores",
        "sft_metrics",
    ]
    assert BY_VIEW["metrics"].file == "train_metrics.parquet" and BY_VIEW["metrics"].schema is schemas.TRAIN_METRICS


def test_the_manifest_answers_completed_by_stage_and_iteration(run):
    for iteration in (2, 0):
        path = run.write(ADVANTAGE, iteration, _advantages(iteration))
        run.record_done(ADVANTAGE, iteration, [path], stats={"n_degenerate_groups": 1})
    assert run.recorded_iterations(ADVANTAGE) == [0, 2] and run.recorded_iterations(SCORE) == []
    assert run.completed(ADVANTAGE, 2)["stats"] == {"n_degenerate_groups": 1}
    assert run.read(ADVANTAGE, 0).column("iteration").to_pylist() == [0]
    run.path(ADVANTAGE, 2).write_bytes(b"changed")
    assert run.completed(ADVANTAGE, 2) is None  # a file that changed after it was recorded is not completed
    with pytest.raises(schemas.SchemaError, match="iteration 1"):
        run.write(SCORE, 1, _advantages(1))  # another stage's table


def test_checkpoint_names():
    assert [checkpoint_name(v) for v in (-1, 0, 12)] == ["init", "iter_0000", "iter_0012"]


def test_a_run_of_an_earlier_format_is_refused_naming_what_moved(run):
    manifest = json.loads(run.manifest_path.read_text())
    del manifest["format_version"]
    run.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(RunDirError) as err:
        RunDir.open(run.root)
    message = str(err.value)
    assert "run format 1" in message and "training.kl_beta -> reward.kl_weight" in message
    assert "kl_mean -> kl_base_mean" in message and "start a new run" in message


def test_a_run_that_named_the_harm_score_toxicity_is_refused_naming_the_new_names(run):
    manifest = json.loads(run.manifest_path.read_text())
    manifest["format_version"] = 8
    run.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(RunDirError, match=r"toxicity -> harm, turn_toxicity -> turn_harm.*toxicity_mean -> harm_mean"):
        RunDir.open(run.root)


def test_a_recorded_file_that_changed_or_vanished_is_named_with_the_command_that_recomputes_it(run):
    from redteam_grpo.storage.rundir import DamagedRunError

    path = run.write(ADVANTAGE, 3, _advantages(3))
    run.record_done(ADVANTAGE, 3, [path])
    assert run.read(ADVANTAGE, 3).num_rows == 1
    path.write_bytes(path.read_bytes()[:-8])  # truncated
    with pytest.raises(DamagedRunError) as err:
        run.read(ADVANTAGE, 3)
    assert str(path) in str(err.value) and "does not match the checksum" in str(err.value)
    assert f"redteam-grpo run --resume {run.root} --redo 3/advantage" in str(err.value)
    path.unlink()
    with pytest.raises(DamagedRunError, match="is missing"):
        run.verify_all()


def test_redo_drops_the_stage_the_rest_of_its_iteration_and_later_iterations(run):
    from redteam_grpo.storage.rundir import parse_redo
    from redteam_grpo.storage.stages import CHECKPOINT, SAMPLE, TRAIN_STEP

    for iteration in range(3):
        for stage in (SAMPLE, SCORE, ADVANTAGE, TRAIN_STEP, CHECKPOINT):
            run.record_done(stage, iteration, [])
    run.set_status("early_stopped", stop_kind="reward_target", stop_reason="r")
    dropped = run.forget_from(*parse_redo("1/advantage"))
    assert dropped == ["1/advantage", "1/train_step", "1/checkpoint"] + [
        f"2/{s}" for s in ("sample", "score", "advantage", "train_step", "checkpoint")
    ]
    assert run.completed(SCORE, 1) is not None and run.completed_iterations() == [0]
    assert run.manifest()["status"] == "running" and "stop_kind" not in run.manifest()
    assert parse_redo("4") == (ALL_STAGES[0], 4)  # the first stage of every mode: the whole iteration
    with pytest.raises(RunDirError, match="--redo 7/train_step"):
        parse_redo("7/scores")


def test_pruned_weights_of_old_iterations_do_not_make_their_tables_unreadable(run):
    from redteam_grpo.storage.stages import CHECKPOINT, TRAIN_STEP

    for iteration in (0, 1):
        table = run.write(ADVANTAGE, iteration, _advantages(iteration))
        weights = run.checkpoint_dir(iteration) / "adapter.safetensors"
        weights.parent.mkdir(parents=True)
        weights.write_bytes(b"weights")
        run.record_done(ADVANTAGE, iteration, [table])
        run.record_done(TRAIN_STEP, iteration, [weights])  # a train step records the weights it wrote
        run.record_done(CHECKPOINT, iteration, [])
    (run.checkpoint_dir(0) / "adapter.safetensors").unlink()  # run.keep_checkpoints=1 pruned it
    run.verify_all()  # a resume builds on iteration 1's weights only
    assert run.read(ADVANTAGE, 0).num_rows == 1
    (run.checkpoint_dir(1) / "adapter.safetensors").write_bytes(b"damaged")
    with pytest.raises(RunDirError, match=r"--redo 1/train_step"):
        run.verify_all()


def test_a_redo_whose_starting_weights_were_pruned_is_refused_before_anything_is_dropped(run):
    from redteam_grpo.storage import checkpoints
    from redteam_grpo.storage.rundir import parse_redo
    from redteam_grpo.storage.stages import CHECKPOINT, TRAIN_STEP

    for iteration in (0, 1, 2):
        folder = run.checkpoint_dir(iteration)
        folder.mkdir(parents=True)
        (folder / checkpoints.ADAPTER_FILE).write_bytes(b"weights")
        checkpoints.write_manifest(folder, {})
        run.record_done(TRAIN_STEP, iteration, [folder / checkpoints.ADAPTER_FILE])
        run.record_done(CHECKPOINT, iteration, [folder / checkpoints.MANIFEST_FILE])
    for pruned in (0, 1):
        for path in run.checkpoint_dir(pruned).iterdir():
            path.unlink()
    before = run.manifest()
    with pytest.raises(RunDirError, match=r"the earliest redo that can work is --redo 3"):
        run.check_redo(*parse_redo("2/score"))
    assert run.manifest() == before
    run.check_redo(*parse_redo("2/checkpoint"))  # its own weights are intact: resealing is possible


def _parts(run, iteration: int, shards: int) -> list:
    """Write and record `shards` parts of ADVANTAGE (one row each), then the stage."""
    paths = []
    for k in range(shards):
        table = _advantages(iteration).set_column(2, "prompt_id", pa.array([f"p{k}"]))
        path = run.write(ADVANTAGE, iteration, table, run.part_path(ADVANTAGE, iteration, k, shards))
        run.record_part(ADVANTAGE, iteration, k, path, 1)
        paths.append(path)
    return paths


def test_a_sharded_stage_is_read_as_one_table_of_its_parts_in_shard_order(run):
    assert run.part_path(ADVANTAGE, 0, 0, 1) == run.path(ADVANTAGE, 0)  # one shard: the stage's own file
    paths = _parts(run, 0, 3)
    assert [p.name for p in paths] == [f"advantages-0000{k}-of-00003.parquet" for k in range(3)]
    assert all(run.completed_part(ADVANTAGE, 0, k) for k in range(3))
    assert run.completed(ADVANTAGE, 0) is None  # not before every part is in and the stage recorded
    run.record_done(ADVANTAGE, 0, paths, parts=paths, rows=3, stats={})
    assert run.read(ADVANTAGE, 0).column("prompt_id").to_pylist() == ["p0", "p1", "p2"]
    assert run.read_part(ADVANTAGE, 0, 1, 3).column("prompt_id").to_pylist() == ["p1"]
    assert "0/advantage" not in run.manifest().get("shards", {})  # folded into the stage's record
    from redteam_grpo.storage import query

    assert query.query(run, "select count(*) as n from advantages").n[0] == 3


def test_a_damaged_part_is_named_by_every_reader_and_a_changed_one_is_computed_again(run):
    paths = _parts(run, 0, 2)
    paths[1].write_bytes(paths[1].read_bytes()[:-8] + b"damaged!")
    assert run.completed_part(ADVANTAGE, 0, 1) is None and run.completed_part(ADVANTAGE, 0, 0)
    with pytest.raises(RunDirError, match=r"advantages-00001-of-00002\.parquet is not a recorded, intact part"):
        run.read_parts(ADVANTAGE, 0, 2)
    paths = _parts(run, 1, 2)
    run.record_done(ADVANTAGE, 1, paths, parts=paths, rows=2, stats={})
    paths[1].unlink()
    with pytest.raises(RunDirError, match=r"advantages-00001-of-00002.parquet is missing.*--redo 1/advantage"):
        run.read(ADVANTAGE, 1)


def test_redo_drops_the_recorded_parts_of_a_stage_not_yet_complete(run):
    _parts(run, 2, 2)
    run.forget_from(ADVANTAGE, 2)
    assert not run.manifest()["shards"] and run.completed_part(ADVANTAGE, 2, 0) is None


def _seal_iterations(run, iterations) -> dict[int, int]:
    """Record every attack stage of each iteration with a file, then seal it as the checkpoint stage does (its
    checkpoint keeps `record_for_checkpoint`); the size of each checkpoint's copy, by iteration."""
    from redteam_grpo.storage import checkpoints
    from redteam_grpo.storage.rundir import RUN_RECORD
    from redteam_grpo.storage.stages import CHECKPOINT, SAMPLE, TRAIN_STEP

    copies = {}
    for iteration in iterations:
        for stage in (SAMPLE, SCORE, ADVANTAGE, TRAIN_STEP):
            path = run.iteration_dir(iteration) / f"{stage.name}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(stage.name.encode())
            run.record_done(stage, iteration, [path], stats={"rows": 12})
        folder = run.checkpoint_dir(iteration)
        folder.mkdir(parents=True, exist_ok=True)
        copy = run.record_for_checkpoint(iteration)
        copies[iteration] = len(json.dumps(copy))
        checkpoints.write_manifest(folder, {RUN_RECORD: copy})
        run.record_done(CHECKPOINT, iteration, [folder / checkpoints.MANIFEST_FILE])
    return copies


def test_what_each_stage_rewrites_stays_the_same_size_however_long_the_run_and_each_record_is_written_once(run):
    """A run format before 12 rewrote every record of the run after every stage and copied them all into every
    checkpoint: quadratic in the run's length (0.5 MB per checkpoint at 200 iterations)."""
    from redteam_grpo.storage.location import version_of
    from redteam_grpo.storage.stages import SAMPLE

    copies = _seal_iterations(run, range(5))
    first_records = version_of(run.records_path(0))
    early = len(run.manifest_path.read_bytes())
    copies |= _seal_iterations(run, range(5, 30))
    late = len(run.manifest_path.read_bytes())
    # what grows is the index of sealed iterations: ~10 bytes an iteration, against ~900 when the records stayed
    assert late - early < 25 * 20, (early, late)
    assert abs(copies[29] - copies[4]) <= 16, copies  # the iterations' numbers in the keys, nothing more
    assert version_of(run.records_path(0)) == first_records  # written once, when sealed
    assert run.completed_iterations() == list(range(30)) and run.completed(SAMPLE, 3) is not None
    assert len(run.manifest()["stages"]) == 30 * 5  # the whole record still reads back as one


def test_a_damaged_records_file_is_named_and_rebuilt_from_its_own_checkpoint(run):
    from redteam_grpo.storage.rundir import DamagedRunError
    from redteam_grpo.storage.stages import SAMPLE

    _seal_iterations(run, range(3))
    before = run.manifest()["stages"]
    records = run.records_path(1)
    records.write_text("{ not json")
    with pytest.raises(DamagedRunError, match=f"rebuild-manifest {run.root}"):
        run.completed(SAMPLE, 1)
    rebuilt = run.rebuild_manifest()
    assert rebuilt.iterations == [0, 1, 2] and rebuilt.skipped == []
    assert records.with_name("records.json.damaged").read_text() == "{ not json"  # nothing written before is lost
    after = run.manifest()["stages"]
    assert after.keys() == before.keys()
    assert all(
        after[k]["files"] == before[k]["files"] and after[k].get("stats") == before[k].get("stats") for k in after
    )
