"""What a run folder, a config or a manifest written by someone else cannot do (SECURITY.md): put a run outside its
runs folder, make a reader open a file outside the run, or make a writer write through a link planted beside the
file it writes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from redteam_grpo.core.config import ConfigError, load_config
from redteam_grpo.core.names import is_component, is_relative_name
from redteam_grpo.storage import atomic, checkpoints, lineage, ownership
from redteam_grpo.storage.rundir import OWNER_FILE, DamagedRunError, RunDir, RunDirError

ESCAPES = ["../../outside", "/etc/passwd", "a/../../b", "~/x", "a\\..\\b", "", ".", "..", ".hidden", "a//b"]


@pytest.mark.parametrize("name", ESCAPES)
def test_a_name_that_could_leave_its_folder_is_neither_a_component_nor_a_relative_name(name):
    assert not is_relative_name(name)
    assert not is_component(name)


def test_the_names_a_run_writes_are_relative_names():
    assert is_relative_name("iter_0003/rollouts-00001-of-00004.parquet")
    assert is_component("redteam-20261127-193700-000001")
    assert not is_component("iter_0003/rollouts.parquet")


@pytest.mark.parametrize("setting", ["run.run_id", "run.name"])
@pytest.mark.parametrize("value", ["../../escaped", "/tmp/elsewhere", "a/b"])
def test_a_run_name_or_id_that_would_leave_runs_dir_is_refused_naming_the_field(tmp_path, setting, value):
    with pytest.raises(ConfigError, match=setting.split(".")[1]) as caught:
        load_config(None, [f"run.runs_dir={tmp_path / 'runs'}", f"{setting}={value}"])
    assert "one folder name" in str(caught.value)
    assert not (tmp_path / "escaped").exists()


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir.create(load_config(None, [f"run.runs_dir={tmp_path / 'runs'}", "run.run_id=r"]))


def _craft_manifest(run: RunDir, change) -> None:
    data = json.loads(run.manifest_path.read_text())
    change(data)
    run.manifest_path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["stages"].__setitem__("0000/sample", {"files": {"../../secret": "0" * 64}}),
        lambda m: m["stages"].__setitem__("0000/sample", {"files": {}, "parts": ["/etc/passwd"]}),
        lambda m: m.setdefault("shards", {}).__setitem__("0000/score", {"0": {"files": {"../x": "0"}}}),
        lambda m: m.__setitem__("parent_run", "../../other-user/run"),
    ],
    ids=["file", "part", "shard", "parent"],
)
def test_a_manifest_that_names_a_path_outside_the_run_is_a_damaged_run_named(run, change):
    _craft_manifest(run, change)
    with pytest.raises(DamagedRunError, match=r"outside the run's folder|not one folder name") as caught:
        run.manifest()
    assert str(run.manifest_path) in str(caught.value)


def test_a_checkpoint_manifest_that_names_a_file_outside_its_folder_is_refused_before_reading_it(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not ours")
    folder = tmp_path / "checkpoints" / "iter_0000"
    folder.mkdir(parents=True)
    checkpoints.save_adapter(folder / checkpoints.ADAPTER_FILE, {"w": torch.ones(2)})
    checkpoints.write_manifest(folder, {"iteration": 0})
    manifest = json.loads((folder / checkpoints.MANIFEST_FILE).read_text())
    manifest["files"]["../../outside.bin"] = atomic.sha256_file(outside)  # an intact file, outside the checkpoint
    (folder / checkpoints.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(checkpoints.CheckpointError, match="outside its folder"):
        checkpoints.read_manifest(folder)


def test_a_lineage_record_whose_parent_leaves_runs_dir_is_refused(run):
    (run.root / lineage.LINEAGE_FILE).write_text(
        json.dumps({"lineage": "l", "generation": 1, "parent_run": "../../elsewhere", "parent_checkpoint": "iter_0001"})
    )
    with pytest.raises(RunDirError, match="not one folder name"):
        lineage.read_lineage(run)


def test_a_write_never_goes_through_a_link_planted_at_a_temporary_name(tmp_path):
    """The temporary name was `.tmp-<pid>-<name>`: a link planted there sent the write to its target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "config.json"
    (tmp_path / f"{atomic.TMP_PREFIX}{os.getpid()}-{target.name}").symlink_to(victim)
    atomic.write_json_atomic(target, {"written": True})
    assert victim.read_text() == "keep me"
    assert json.loads(target.read_text()) == {"written": True}
    assert not target.is_symlink()


def test_two_temporaries_of_one_file_have_different_names_and_exist_only_while_written(tmp_path):
    target, seen = tmp_path / "f.json", []
    for _ in range(2):
        with atomic.atomic_path(target) as tmp:
            seen.append(tmp.name)
            assert tmp.is_file() and not tmp.is_symlink()
            tmp.write_text("{}")
    assert seen[0] != seen[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_an_owner_lock_planted_as_a_link_is_refused_and_its_target_left_whole(run, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (run.root / OWNER_FILE).unlink(missing_ok=True)
    (run.root / OWNER_FILE).symlink_to(victim)
    with pytest.raises(RunDirError, match="symbolic link"):
        ownership.acquire(run.root)
    assert victim.read_text() == "keep me"


def test_the_sampler_folder_of_a_remote_run_is_made_fresh_and_private_not_a_guessable_temp_path(memory_store):
    run = RunDir.create(load_config(None, [f"run.runs_dir={memory_store}/runs", "run.run_id=remote"]))
    folder = run.sampler_dir
    assert folder == RunDir.open(run.root).sampler_dir  # the same for every reader in this process
    assert folder != Path("/tmp") / "redteam-grpo-sampler" / "remote"
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_dataset_export_never_writes_through_a_link_planted_at_a_temporary_folder_name(tmp_path):
    """The export's folder was written as `.tmp-<pid>-<name>` beside it: a link planted there took the dataset."""
    import pandas as pd

    from redteam_grpo.storage.export import write_hf_dataset

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep me")
    out = tmp_path / "exported" / "hf_dataset"
    out.parent.mkdir()
    (out.parent / f"{atomic.TMP_PREFIX}{os.getpid()}-{out.name}").symlink_to(victim, target_is_directory=True)
    write_hf_dataset(pd.DataFrame({"prompt": ["a", "b"]}), out)
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert out.is_dir() and not out.is_symlink() and (out / "dataset_info.json").is_file()


def test_a_sealed_iterations_records_that_name_a_path_outside_the_run_are_a_damaged_run_named(run):
    from redteam_grpo.storage.stages import CHECKPOINT, SAMPLE

    run.record_done(SAMPLE, 0, [])
    run.record_done(CHECKPOINT, 0, [])  # sealed: its records move to iter_0000/records.json
    records = run.records_path(0)
    records.write_text(json.dumps({"stages": {"0/sample": {"files": {"../../secret": "0" * 64}}}}))
    with pytest.raises(DamagedRunError, match="outside the run's folder") as caught:
        run.completed(SAMPLE, 0)
    assert str(records) in str(caught.value) and "rebuild-manifest" in str(caught.value)
