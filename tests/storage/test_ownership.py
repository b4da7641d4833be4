"""One owner per run directory, temporary files left by interrupted writes, and a creation cut short."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from redteam_grpo.core.config import load_config
from redteam_grpo.storage import atomic, checkpoints, interrupts, ownership
from redteam_grpo.storage.rundir import OWNER_FILE, RunDir, RunDirError
from tests.processes import dispositions, handlers, hold_a_run_lock

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path, run_id="r"):
    return load_config(None, [f"run.runs_dir={tmp_path}", f"run.run_id={run_id}"])


@pytest.fixture(params=["local", "file-url"])
def run(request, tmp_path):
    """A run in a local folder (flock), and one at a file:// URL: the fsspec code path of object storage, where the
    owner record alone says who owns the run."""
    return RunDir.create(_config(tmp_path if request.param == "local" else f"file://{tmp_path}"))


def test_a_second_owner_is_refused_at_once_naming_the_first_and_the_way_out(run):
    with ownership.owning(run.root):
        started = time.monotonic()
        for attempt in (ownership.acquire, ownership.refuse_if_owned):
            with pytest.raises(ownership.RunOwnedElsewhere) as refused:
                attempt(run.root)
            message = str(refused.value)
            assert f"pid {os.getpid()} on {socket.gethostname()}, started " in message
            assert f"kill -TERM {os.getpid()}" in message and f"redteam-grpo run --resume {run.root}" in message
        assert time.monotonic() - started < 1
        assert isinstance(refused.value, RunDirError)  # the CLI's one-line error, exit status 2
    ownership.refuse_if_owned(run.root)
    with ownership.owning(run.root):  # released: the next owner gets it
        pass
    assert ownership.live_owner(run.root) is None  # let go cleanly: the lock names nobody, the record is gone
    if (run.root / OWNER_FILE).exists():
        assert (run.root / OWNER_FILE).read_text() == ""


def test_a_lock_dies_with_its_process_and_the_next_owner_says_it_took_over(run, caplog):
    child = hold_a_run_lock(run.root)
    try:
        with pytest.raises(ownership.RunOwnedElsewhere, match=f"owned by pid {child.pid} on "):
            ownership.acquire(run.root)
        assert ownership.live_owner(run.root).pid == child.pid
        assert ownership.stopped_unexpectedly(run) is None  # running, and owned
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # what kill -9 or the out-of-memory killer leaves: a manifest that says running, and nobody owning the run
    assert ownership.live_owner(run.root) is None
    assert "no process owns it" in ownership.stopped_unexpectedly(run)
    assert f"redteam-grpo run --resume {run.root}" in ownership.stopped_unexpectedly(run)
    with caplog.at_level(logging.WARNING, logger=ownership.__name__), ownership.owning(run.root) as held:
        assert held.owner.pid == os.getpid()
        assert json.loads((run.root / OWNER_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over run r from pid {child.pid} on {socket.gethostname()}" in caplog.text
    assert "is no longer running" in caplog.text
    run.set_status("interrupted")  # a stop that was recorded is not unexpected
    assert ownership.stopped_unexpectedly(run) is None


def test_on_object_storage_a_record_from_another_host_is_refused_until_removed(tmp_path):
    run = RunDir.create(_config(f"file://{tmp_path}"))
    elsewhere = {"pid": 4242, "host": "another-host", "started_at": "2026-01-01T00:00:00+00:00"}
    (run.root / OWNER_FILE).write_text(json.dumps(elsewhere))
    for attempt in (ownership.acquire, ownership.refuse_if_owned):
        with pytest.raises(ownership.RunOwnedElsewhere) as refused:
            attempt(run.root)
        message = str(refused.value)
        assert "pid 4242 on another-host" in message and f"delete {run.root / OWNER_FILE}" in message
    assert json.loads((run.root / OWNER_FILE).read_text()) == elsewhere  # the record is left as it was
    (run.root / OWNER_FILE).unlink()
    with ownership.owning(run.root) as held:
        assert json.loads((run.root / OWNER_FILE).read_text())["pid"] == held.owner.pid == os.getpid()
    assert not (run.root / OWNER_FILE).exists()  # let go: the next owner creates its own record


@pytest.mark.parametrize("store", ["file-url", "memory"])
def test_on_object_storage_two_owners_that_both_found_no_record_are_not_both_let_in(
    tmp_path, memory_store, monkeypatch, store
):
    """The record used to be checked, then written: two processes that both read "nobody" both wrote their record
    and both ran the run's stages. It is created only where none exists, so the second is refused."""
    run = RunDir.create(_config(f"file://{tmp_path}" if store == "file-url" else memory_store))
    monkeypatch.setattr(ownership, "_refuse_if_recorded", lambda root, lock: None)  # both checked before either wrote
    first = ownership.acquire(run.root)
    with pytest.raises(ownership.RunOwnedElsewhere, match=f"owned by pid {os.getpid()} .* a moment before"):
        ownership.acquire(run.root)
    assert json.loads((run.root / OWNER_FILE).read_text()) == first.owner.__dict__  # the first's record stands
    first.release()
    assert not (run.root / OWNER_FILE).exists()
    ownership.acquire(run.root).release()  # the next owner gets it


def test_on_object_storage_a_record_left_empty_by_an_older_version_is_taken_over(tmp_path):
    run = RunDir.create(_config(f"file://{tmp_path}"))
    (run.root / OWNER_FILE).write_text("")  # how earlier versions let go
    with ownership.owning(run.root) as held:
        assert json.loads((run.root / OWNER_FILE).read_text())["pid"] == held.owner.pid


def test_only_temporary_files_are_removed_and_counted(run):
    leftovers = [
        run.iteration_dir(0) / f"{atomic.TMP_PREFIX}123-rollouts.parquet",
        run.checkpoint_dir(0) / f"{atomic.TMP_PREFIX}123-optimizer.safetensors",
        run.root / f"{atomic.TMP_PREFIX}123-manifest.json",
    ]
    kept = run.checkpoint_dir(0) / checkpoints.ADAPTER_FILE
    for path in [*leftovers, kept]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
    assert run.remove_temporary_files() == 3
    assert not any(p.exists() for p in leftovers) and kept.exists() and run.manifest_path.exists()
    assert run.remove_temporary_files() == 0


def test_a_checkpoint_never_lists_a_temporary_file_beside_its_weights(tmp_path):
    folder = tmp_path / "iter_0000"
    folder.mkdir()
    (folder / checkpoints.ADAPTER_FILE).write_bytes(b"weights")
    (folder / f"{atomic.TMP_PREFIX}99-{checkpoints.OPTIMIZER_FILE}").write_bytes(b"half written")
    checkpoints.write_manifest(folder, {})
    assert list(checkpoints.read_manifest(folder)["files"]) == [checkpoints.ADAPTER_FILE]


def test_a_creation_killed_before_its_manifest_is_reported_and_can_be_started_again(tmp_path, monkeypatch):
    config = _config(tmp_path, "cut")
    real_write = atomic.write_json_atomic

    def killed_at_the_manifest(path, data):
        if path.name == "manifest.json":
            (path.parent / f"{atomic.TMP_PREFIX}1-manifest.json").write_text("{")  # what a kill leaves
            raise KeyboardInterrupt("killed during the first manifest write")
        real_write(path, data)

    monkeypatch.setattr("redteam_grpo.storage.rundir.write_json_atomic", killed_at_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        RunDir.create(config)
    monkeypatch.undo()
    root = tmp_path / "cut"
    (root / OWNER_FILE).touch()
    with pytest.raises(RunDirError, match=f"never started.*redteam-grpo run --config {root / 'config.json'}"):
        RunDir.open(root)
    run = RunDir.create(config)  # the same run id: the folder holds no run yet, so it is taken over
    assert run.manifest()["status"] == "running" and run.stored_config().run.run_id == "cut"
    assert not list(root.glob(f"{atomic.TMP_PREFIX}*"))
    assert RunDir.open(root).manifest()["stages"] == {}
    with pytest.raises(RunDirError, match="already exists: resume it"):
        RunDir.create(config)


def test_a_folder_with_other_files_is_not_taken_for_an_unfinished_run(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"not a run directory \(notes.txt"):
        RunDir.create(_config(tmp_path))


def test_a_signal_during_recording_is_delivered_after_it(run):
    # Python's SIGINT handler, whatever this process inherited (a runner started in the background ignores SIGINT)
    with handlers({signal.SIGINT: signal.default_int_handler}):
        with pytest.raises(KeyboardInterrupt), interrupts.recording():
            signal.raise_signal(signal.SIGINT)
            run.set_status("recorded before the interrupt")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert run.manifest()["status"] == "recorded before the interrupt"


def test_a_signal_ignored_stays_ignored_while_recording(tmp_path):
    # bug class inherited-sig-ign-overridden: a process started with SIGINT ignored (`nohup`, a background job)
    # would stop on a SIGINT that came while a stage was recorded
    run = RunDir.create(_config(tmp_path))
    with handlers({signum: signal.SIG_IGN for signum in interrupts.STOP_SIGNALS}):
        with interrupts.recording():
            assert dispositions() == {signum: signal.SIG_IGN for signum in interrupts.STOP_SIGNALS}
            for signum in interrupts.STOP_SIGNALS:
                signal.raise_signal(signum)
            run.set_status("recorded, the signals ignored")
        assert dispositions() == {signum: signal.SIG_IGN for signum in interrupts.STOP_SIGNALS}
    assert run.manifest()["status"] == "recorded, the signals ignored"
