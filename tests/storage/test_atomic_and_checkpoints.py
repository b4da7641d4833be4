import json

import pytest
import torch
from safetensors.torch import load_file

from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.atomic import TMP_PREFIX, write_atomic, write_json_atomic
from redteam_grpo.storage.location import location


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "data.json"
    write_json_atomic(path, {"v": 1})

    def crash(tmp):
        tmp.write_text('{"v": 2, "half')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, crash)
    assert json.loads(path.read_text()) == {"v": 1}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_an_upload_cut_short_leaves_the_old_object_whole_and_no_temporary(memory_store, monkeypatch):
    path = location(memory_store) / "runs" / "manifest.json"
    write_json_atomic(path, {"v": 1})
    store = path.fs

    def cut_short(local, remote, **kwargs):  # half the bytes reached the store, then the connection broke
        with store.open(remote, "wb") as handle:
            handle.write(b'{"v": 2, "hal')
        raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(store, "put_file", cut_short)
    with pytest.raises(ConnectionError):
        write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]


def test_checkpoints_round_trip_through_object_storage(memory_store):
    folder = location(memory_store) / "checkpoints" / "iter_0000"
    params, opt = _optimizer()
    checkpoints.save_optimizer(folder / checkpoints.OPTIMIZER_FILE, opt)
    checkpoints.save_adapter(folder / checkpoints.ADAPTER_FILE, {"w": torch.ones(2)})
    checkpoints.write_manifest(folder, {"iteration": 0})
    assert set(checkpoints.read_manifest(folder)["files"]) == {checkpoints.OPTIMIZER_FILE, checkpoints.ADAPTER_FILE}
    restored = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=5.0)
    checkpoints.load_optimizer(folder / checkpoints.OPTIMIZER_FILE, restored)
    assert restored.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for a, b in zip(opt.state_dict()["state"].values(), restored.state_dict()["state"].values(), strict=True):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=0, atol=0)
    (folder / checkpoints.ADAPTER_FILE).write_bytes(b"\0" * 8)
    with pytest.raises(checkpoints.CheckpointError, match=r"adapter\.safetensors does not match its checksum"):
        checkpoints.read_manifest(folder)


def _optimizer():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.95))
    for _ in range(2):
        opt.zero_grad()
        sum((p**2).sum() for p in params).backward()
        opt.step()
    return params, opt


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    params, opt = _optimizer()
    checkpoints.save_optimizer(tmp_path / "opt.safetensors", opt)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = torch.optim.AdamW(fresh_params, lr=5.0)
    checkpoints.load_optimizer(tmp_path / "opt.safetensors", fresh)
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for index in a["state"]:
        for key in a["state"][index]:
            torch.testing.assert_close(a["state"][index][key], b["state"][index][key])
    # and both continue identically
    for o, ps in ((opt, params), (fresh, fresh_params)):
        o.zero_grad()
        sum((p**2).sum() for p in ps).backward()
        o.step()
    for p, q in zip(params, fresh_params, strict=True):
        torch.testing.assert_close(p, q)


def test_the_same_optimizer_state_is_always_the_same_file(tmp_path):
    # so that comparing two runs' checkpoints by checksum means something: safetensors orders a metadata map by hash,
    # which changes from one map to the next (two entries differed in about half of the saves)
    _, opt = _optimizer()
    files = [tmp_path / f"opt{i}.safetensors" for i in range(10)]
    for path in files:
        checkpoints.save_optimizer(path, opt)
    assert len({path.read_bytes() for path in files}) == 1


def test_an_optimizer_file_with_its_groups_and_scalars_in_two_entries_still_loads(tmp_path):
    params, opt = _optimizer()
    state = opt.state_dict()
    tensors = {f"state.{i}.{k}": v for i, values in state["state"].items() for k, v in values.items() if k != "step"}
    scalars = {
        f"{i}.step": values["step"] for i, values in state["state"].items() if not torch.is_tensor(values["step"])
    }
    tensors |= {f"state.{i}.step": v["step"] for i, v in state["state"].items() if torch.is_tensor(v["step"])}
    metadata = {"param_groups": json.dumps(state["param_groups"]), "scalars": json.dumps(scalars)}
    checkpoints.save_tensors(tmp_path / "old.safetensors", tensors, metadata)
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=5.0)
    checkpoints.load_optimizer(tmp_path / "old.safetensors", fresh)
    assert fresh.state_dict()["param_groups"] == state["param_groups"]
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_optimizer_for_other_parameters_is_refused(tmp_path):
    _, opt = _optimizer()
    checkpoints.save_optimizer(tmp_path / "opt.safetensors", opt)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(checkpoints.CheckpointError, match="different set of parameters"):
        checkpoints.load_optimizer(tmp_path / "opt.safetensors", other)


def test_manifest_detects_missing_and_corrupt_files(tmp_path):
    checkpoints.save_adapter(tmp_path / checkpoints.ADAPTER_FILE, {"w": torch.ones(2)})
    with pytest.raises(checkpoints.CheckpointError, match="not a complete checkpoint"):
        checkpoints.read_manifest(tmp_path)
    checkpoints.write_manifest(tmp_path, {"iteration": 0})
    assert checkpoints.read_manifest(tmp_path)["iteration"] == 0
    data = bytearray((tmp_path / checkpoints.ADAPTER_FILE).read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / checkpoints.ADAPTER_FILE).write_bytes(bytes(data))
    with pytest.raises(checkpoints.CheckpointError, match="does not match its checksum"):
        checkpoints.read_manifest(tmp_path)


def test_an_adapter_with_non_finite_values_is_never_written_and_the_old_file_stays(tmp_path):
    path = tmp_path / checkpoints.ADAPTER_FILE
    checkpoints.save_adapter(path, {"w": torch.ones(2)})
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([float("inf"), 0.0])):
        with pytest.raises(checkpoints.CheckpointError, match=r"NaN or infinite values \(w, \.\.\.\).*learning_rate"):
            checkpoints.save_adapter(path, {"w": bad})
    assert torch.equal(load_file(path)["w"], torch.ones(2))  # the last good adapter is left as it was
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_a_full_disk_worded_by_a_library_is_a_full_disk_naming_the_file(tmp_path):
    """safetensors (Rust) raises its own error for ENOSPC; it must read as a full disk, not a damaged file."""
    import errno

    from safetensors import SafetensorError

    path = tmp_path / checkpoints.ADAPTER_FILE

    def full(tmp):
        tmp.write_bytes(b"partial")
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    with pytest.raises(OSError) as err:
        write_atomic(path, full)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert not path.exists() and list(tmp_path.iterdir()) == []
