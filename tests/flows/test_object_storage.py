"""A run directory at a URL (run.runs_dir=s3://bucket/runs): the Parquet parts, manifest, config and checkpoints go
through fsspec file systems. Object storage is not reachable from the tests: they run the same code path on fsspec's
in-memory file system (object-store semantics in one process: no rename, no lock) and on file:// URLs (shared by the
run's process and its Ray workers), and check that the run computes exactly what a run in a local folder computes."""

from __future__ import annotations

import fsspec
import pandas as pd
import pytest
import torch
from safetensors.torch import load

from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.storage import query
from redteam_grpo.storage.atomic import TMP_PREFIX
from redteam_grpo.storage.checkpoints import ADAPTER_FILE
from redteam_grpo.storage.location import is_remote
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ADVANTAGE, SAMPLE, SCORE
from tests.small_runs import SMALL_RUN, assert_same_rows

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")

SETTINGS = [*SMALL_RUN, "data.prompts_per_iteration=4", "runtime.shards=2"]
KEYS = ["prompt_id", "sample_idx"]


def _config(runs_dir, run_id, *extra):
    return load_config(None, [*SETTINGS, f"run.runs_dir={runs_dir}", f"run.run_id={run_id}", *extra])


def _rows(run: RunDir, stage, iteration: int) -> pd.DataFrame:
    df = run.read(stage, iteration).to_pandas().drop(columns="run_id")
    return df.sort_values(KEYS).reset_index(drop=True)


def _assert_same_run(url_run: RunDir, folder_run: RunDir, iterations: int, exact: bool = True) -> None:
    """The same rows and the same weights; `exact=False`: to float tolerance (a Ray worker's matrix products may
    sum in another order than the run's process)."""
    for iteration in range(iterations):
        for stage in (SAMPLE, SCORE, ADVANTAGE):
            assert_same_rows(_rows(url_run, stage, iteration), _rows(folder_run, stage, iteration), exact=exact)
    last = iterations - 1
    adapters = [(run.checkpoint_dir(last) / ADAPTER_FILE).read_bytes() for run in (url_run, folder_run)]
    if exact:
        assert adapters[0] == adapters[1]  # the same update, bit for bit
    else:
        ours, theirs = (load(a) for a in adapters)
        assert ours.keys() == theirs.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, prefect_harness, embedded_assets) -> RunDir:
    """The reference: two iterations in a local folder."""
    runs_dir = tmp_path_factory.mktemp("runs")
    attack.attack_run(config=_config(runs_dir, "folder", "run.iterations=2").model_dump(mode="json"))
    return RunDir(runs_dir / "folder")


def test_a_run_on_object_storage_computes_what_a_run_in_a_folder_does(memory_store, folder_run):
    cfg = _config(f"{memory_store}/runs", "url", "run.iterations=2", "run.keep_checkpoints=1")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(f"{memory_store}/runs/url")
    assert is_remote(run.root) and run.manifest()["status"] == "completed"
    _assert_same_run(run, folder_run, iterations=2)
    assert run.manifest()["stages"]["1/sample"]["parts"] == [
        "iter_0001/rollouts-00000-of-00002.parquet",
        "iter_0001/rollouts-00001-of-00002.parquet",
    ]
    run.verify_all()
    # everything lives in the store: nothing half-written, the pruned checkpoint gone, the owner let go
    store = fsspec.filesystem("memory")
    files = [p.removeprefix(f"/{memory_store.removeprefix('memory://')}/runs/url/") for p in store.find(run.root.path)]
    assert "manifest.json" in files and "checkpoints/iter_0001/manifest.json" in files
    assert not [f for f in files if TMP_PREFIX in f]
    assert not [f for f in files if f.startswith("checkpoints/iter_0000/")]  # run.keep_checkpoints=1
    assert not (run.root / "owner.lock").exists()  # the owner deleted its record when it let go
    # DuckDB reads the parts through the same file system
    assert query.summary(run).iteration.tolist() == [0, 1]
    assert query.query(run, "select count(*) as n from rollouts").n[0] == 2 * 4 * 4


def test_ray_workers_write_parts_at_a_file_url_and_a_resume_continues_there(tmp_path, folder_run):
    url = f"file://{tmp_path}/runs"
    cfg = _config(url, "ray", "run.iterations=1", "runtime.task_runner=ray", "runtime.ray_num_cpus=2")
    attack.attack_run(config=cfg.model_dump(mode="json"))
    assert (tmp_path / "runs" / "ray" / "iter_0000" / "scores-00001-of-00002.parquet").is_file()
    # resumed on the local runner for one more iteration: the run a folder holds after two
    attack.attack_run(resume=f"{url}/ray", overrides=["run.iterations=2", "runtime.task_runner=local"])
    run = RunDir.open(f"{url}/ray")
    assert run.manifest()["status"] == "completed" and run.completed_iterations() == [0, 1]
    _assert_same_run(run, folder_run, iterations=2, exact=False)


def test_a_damaged_part_on_object_storage_is_named_with_the_redo_that_recomputes_it(memory_store, folder_run):
    attack.attack_run(config=_config(f"{memory_store}/runs", "d", "run.iterations=1").model_dump(mode="json"))
    run = RunDir.open(f"{memory_store}/runs/d")
    part = run.part_path(SCORE, 0, 1, 2)
    part.write_bytes(part.read_bytes()[:-8] + b"\0" * 8)  # same size, other content: a new object in the store
    with pytest.raises(Exception, match=r"scores-00001-of-00002.parquet does not match the checksum") as err:
        attack.attack_run(resume=str(run.root), overrides=["run.iterations=2"])
    assert f"--resume {run.root} --redo 0/score" in str(err.value)
