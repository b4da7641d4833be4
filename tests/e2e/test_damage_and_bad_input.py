"""What a person meets when a finished run is damaged or an input is wrong: one `error:` line that names the file or
field and the way out (exit 2), never a traceback, never a silent exit 0, and no run directory left behind by an
input that fails its checks. Each case works on its own copy of one real two-iteration run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from redteam_grpo.cli.main import app
from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SAMPLE, SCORE
from tests.processes import dispositions
from tests.small_runs import SMALL_RUN

runner = CliRunner()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, prefect_harness, embedded_assets) -> Path:
    root = tmp_path_factory.mktemp("finished")
    cfg = load_config(None, ["run.iterations=2", *SMALL_RUN, f"run.runs_dir={root}", "run.run_id=done"])
    return Path(attack.attack_run(config=cfg.model_dump(mode="json")))


@pytest.fixture
def copy(finished, tmp_path) -> RunDir:
    target = tmp_path / "runs" / finished.name
    shutil.copytree(finished, target)
    return RunDir.open(target)


def _cli(*args, monkeypatch=None) -> tuple[int, str]:
    result = runner.invoke(app, list(map(str, args)), env={"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"})
    return result.exit_code, result.output


def _one_error_line(code: int, out: str, *named: str) -> str:
    assert code == 2, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    for text in named:
        assert text in errors[0], errors[0]
    return errors[0]


def test_flipped_bytes_in_the_last_adapter_stop_a_resume_before_any_training(copy):
    adapter = copy.checkpoint_dir(1) / checkpoints.ADAPTER_FILE
    damaged = bytearray(adapter.read_bytes())
    damaged[-16] ^= 0xFF
    adapter.write_bytes(bytes(damaged))
    found = dispositions()  # Python's defaults, or SIGINT ignored where this runner was started in the background
    code, out = _cli("run", "--resume", copy.root, "--set", "run.iterations=3")
    _one_error_line(code, out, str(adapter), "--redo 1/train_step")
    assert copy.completed_iterations() == [0, 1]
    # the command ran inside this process: it must leave the signal handlers as it found them
    assert dispositions() == found


def test_a_damaged_newest_adapter_is_left_out_of_the_checkpoints_offered_with_the_way_to_rewrite_it(copy):
    adapter = copy.checkpoint_dir(1) / checkpoints.ADAPTER_FILE
    damaged = bytearray(adapter.read_bytes())
    damaged[-16] ^= 0xFF
    adapter.write_bytes(bytes(damaged))
    for args in (
        ("infer", "--run", copy.root, "--prompt", "hi", "--max-new-tokens", "2"),
        ("evaluate", copy.root, "--prompts", "1", "--samples", "1"),
    ):
        code, out = _cli(*args)
        line = _one_error_line(code, out, str(adapter), "completed checkpoints: [0]:", "infer --checkpoint N")
        assert f"--resume {copy.root} --redo 1/train_step" in line, line


def test_a_truncated_adapter_stops_a_resume_naming_the_file(copy):
    adapter = copy.checkpoint_dir(1) / checkpoints.ADAPTER_FILE
    adapter.write_bytes(adapter.read_bytes()[:100])
    code, out = _cli("run", "--resume", copy.root, "--set", "run.iterations=3")
    _one_error_line(code, out, str(adapter))


def test_a_deleted_rollouts_file_is_named_by_every_reader_and_by_resume(copy):
    rollouts = copy.path(SAMPLE, 0)
    rollouts.unlink()
    config_before = copy.config_path.read_bytes()
    for args in (
        ("inspect", copy.root, "--sql", "select count(*) from rollouts"),
        ("report", copy.root),
        ("export", copy.root),
        ("evaluate", copy.root, "--prompts", "1", "--samples", "1"),
        ("run", "--resume", copy.root, "--set", "run.iterations=3"),
    ):
        code, out = _cli(*args)
        _one_error_line(code, out, str(rollouts), "is missing", "--redo 0/sample")
    # a refused resume changes nothing on disk: the suggested --redo must run to the iterations the run had
    assert copy.config_path.read_bytes() == config_before


def test_a_truncated_scores_file_is_named_by_readers_and_resume(copy):
    scores = copy.path(SCORE, 1)
    scores.write_bytes(scores.read_bytes()[:200])
    for args in (("inspect", copy.root), ("report", copy.root), ("run", "--resume", copy.root)):
        code, out = _cli(*args)
        _one_error_line(code, out, str(scores), "--redo 1/score")


def test_a_manifest_that_is_not_json_is_named_with_the_command_that_rebuilds_it_from_the_checkpoints(copy):
    before = copy.manifest()
    copy.manifest_path.write_text("{ not json")
    for args in (
        ("inspect", copy.root),
        ("run", "--resume", copy.root),
        ("evaluate", copy.root),
        ("infer", "--run", copy.root, "--prompt", "hi"),
        ("export", copy.root, "-o", copy.root.parent / "exported"),
    ):
        code, out = _cli(*args)
        _one_error_line(code, out, str(copy.manifest_path), f"redteam-grpo rebuild-manifest {copy.root}")

    code, out = _cli("rebuild-manifest", copy.root)
    assert code == 0, out
    assert "from checkpoints/iter_0001: iterations 0-1" in out and f"run --resume {copy.root}" in out, out
    assert (copy.root / "manifest.json.damaged").read_text() == "{ not json"  # nothing written before is lost
    rebuilt = copy.manifest()
    assert rebuilt["status"] == "interrupted" and rebuilt["rebuilt_from"] == "checkpoints/iter_0001"
    for key, entry in before["stages"].items():  # every record back, with its checksums and statistics
        assert rebuilt["stages"][key]["files"] == entry["files"], key
        assert rebuilt["stages"][key].get("stats") == entry.get("stats"), key
    assert rebuilt["stages"].keys() == before["stages"].keys()

    written = {p: p.stat().st_mtime_ns for p in copy.root.rglob("*.parquet")}
    code, out = _cli("run", "--resume", copy.root)
    assert code == 0, out
    assert copy.manifest()["status"] == "completed"
    assert {p: p.stat().st_mtime_ns for p in copy.root.rglob("*.parquet")} == written  # nothing recomputed


def test_a_manifest_rebuild_starts_from_the_newest_intact_checkpoint_and_the_resume_recomputes_the_rest(copy):
    """The newest checkpoint damaged as well: the copy in the one before it is used, and iteration 1 runs again."""
    (copy.checkpoint_dir(1) / checkpoints.ADAPTER_FILE).write_bytes(b"damaged")
    copy.manifest_path.write_text("[]")  # valid JSON, not a manifest
    code, out = _cli("inspect", copy.root)
    _one_error_line(code, out, "rebuild-manifest")
    code, out = _cli("rebuild-manifest", copy.root)
    assert code == 0, out
    assert "not used:" in out and "iter_0001" in out and "from checkpoints/iter_0000: iterations 0-0" in out, out
    assert copy.completed_iterations() == [0]
    code, out = _cli("run", "--resume", copy.root)
    assert code == 0, out
    assert copy.completed_iterations() == [0, 1] and copy.checkpoint_intact(1)


def test_a_manifest_rebuild_refuses_a_manifest_that_reads_as_valid(copy):
    code, out = _cli("rebuild-manifest", copy.root)
    _one_error_line(code, out, "reads as valid", "--force")


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("", "is empty: it holds no prompts"),
        ("   \n\n", "is empty: it holds no prompts"),
        ("text\nhello\n", "data.prompt_column 'prompt' is not a column"),
        (None, "does not exist"),
    ],
)
def test_bad_prompt_files_fail_before_a_run_directory_exists(tmp_path, content, named):
    data = tmp_path / "prompts.csv"
    if content is not None:
        data.write_text(content)
    runs = tmp_path / "runs"
    code, out = _cli("run", "--set", f"data.source={data}", "--set", f"run.runs_dir={runs}")
    _one_error_line(code, out, named)
    assert not runs.exists() or not any(runs.iterdir())


def test_a_resume_whose_prompt_file_is_gone_fails_before_any_model_loads(finished, tmp_path, monkeypatch):
    """The data of a run may move between its start and its resume: the resume names the file before a model loads
    (with real models, minutes), and changes nothing on disk."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Describe topic {i}."}) + "\n" for i in range(8)))
    runs = tmp_path / "runs"
    settings = [*SMALL_RUN, "run.iterations=1", f"data.source={data}", f"run.runs_dir={runs}", "run.run_id=moved"]
    code, out = _cli("run", *[arg for setting in settings for arg in ("--set", setting)])
    assert code == 0, out
    data.rename(tmp_path / "elsewhere.jsonl")
    before = (runs / "moved" / "config.json").read_text(), (runs / "moved" / "manifest.json").read_text()

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr("redteam_grpo.tasks.resources.load_policy", no_model)
    code, out = _cli("run", "--resume", runs / "moved", "--set", "run.iterations=2")
    _one_error_line(code, out, f"data.source {data} does not exist")
    assert ((runs / "moved" / "config.json").read_text(), (runs / "moved" / "manifest.json").read_text()) == before


def test_a_prompt_too_long_for_the_model_fails_at_start_not_iterations_later(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello there", "word " * 400, "how are you"]))
    runs = tmp_path / "runs"
    code, out = _cli("run", "--set", f"data.source={data}", "--set", f"run.runs_dir={runs}")
    _one_error_line(code, out, "1 prompts", "model.max_prompt_tokens=256")
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--set", "run.name=[unclosed"), "override 'run.name=[unclosed': the value is not valid YAML"),
        (("--set", "run.seed=18446744073709551616"), "run.seed"),
        (("--set", "training.kl_beta=0.2"), "training.kl_beta: moved to reward.kl_weight"),
        # read from the scorer's config, before any sampling: no run directory is left
        (("--set", "reward.toxic_label=toxicity"), "reward.toxic_label 'toxicity' is not a label of"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, args, named, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr("redteam_grpo.tasks.resources.load_policy", no_model)
    code, out = _cli("run", *args, "--set", f"run.runs_dir={tmp_path}")
    _one_error_line(code, out, named)
    assert list(tmp_path.iterdir()) == []


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    code, out = _cli("run", "--config", path, "--set", f"run.runs_dir={tmp_path / 'runs'}")
    _one_error_line(code, out, str(path), "not UTF-8")


def test_a_full_disk_is_one_line_and_leaves_every_file_whole(copy, monkeypatch):
    import errno
    import os

    from redteam_grpo.storage import atomic

    before = {p: p.read_bytes() for p in copy.root.rglob("*") if p.is_file() and p.name != "owner.lock"}
    real_fsync = os.fsync

    def full(fd):  # every atomic write fails where a full disk fails it: flushing the temporary file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    code, out = _cli("run", "--resume", copy.root, "--set", "run.iterations=3")
    monkeypatch.setattr(atomic.os, "fsync", real_fsync)
    _one_error_line(code, out, "no space left", "redteam-grpo run --resume")
    for path, content in before.items():
        assert path.read_bytes() == content, f"{path} changed"
    assert not [p for p in copy.root.rglob(".tmp-*")], "a temporary file was left behind"


# -- a run folder from someone else never runs code -------------------------------------------------------------


def _model_with_its_own_code(folder: Path, marker: Path) -> Path:
    """A model folder as a hub repo with remote code ships it: the embedded policy's tokenizer, and a config whose
    `auto_map` names a .py of the folder; importing that .py writes `marker`."""
    from redteam_grpo.embedded import resolve_model_path

    folder.mkdir()
    for source in Path(resolve_model_path("embedded:tiny-qwen3")).iterdir():
        if source.name.startswith("tokenizer") or source.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(source, folder / source.name)
    (folder / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel\n"
        "class PlantedConfig(PretrainedConfig):\n    model_type = 'planted'\n"
        "class PlantedModel(PreTrainedModel):\n    config_class = PlantedConfig\n"
    )
    config = {
        "model_type": "planted",
        "architectures": ["PlantedModel"],
        "auto_map": {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("stored_grant", [True, None], ids=["config-sets-trust_remote_code", "config-names-the-model"])
def test_a_run_folder_whose_config_names_model_code_never_runs_it(copy, tmp_path, stored_grant, monkeypatch):
    """`infer`, `evaluate` and `--resume` read the run's stored config: a config that sets trust_remote_code (or
    only names a model with code of its own) is refused, and the code never runs."""
    monkeypatch.delenv("REDTEAM_GRPO_TRUST_REMOTE_CODE", raising=False)
    marker = tmp_path / "code-ran"
    planted = _model_with_its_own_code(tmp_path / "planted-model", marker)
    stored = json.loads(copy.config_path.read_text())
    stored["model"]["policy"] = str(planted)
    if stored_grant is not None:
        stored["model"]["trust_remote_code"] = stored_grant
    copy.config_path.write_text(json.dumps(stored))
    for args in (
        ("infer", "--run", copy.root, "--prompt", "hi", "--max-new-tokens", "2"),
        ("evaluate", copy.root, "--prompts", "1", "--samples", "1"),
        ("run", "--resume", copy.root, "--set", "run.iterations=3"),
    ):
        code, out = _cli(*args)
        assert not marker.exists(), f"{args[0]} ran the model's code: {out}"
        _one_error_line(code, out, "--trust-remote-code")


def test_a_models_own_code_runs_only_when_that_model_is_granted_on_the_command_line(tmp_path, monkeypatch):
    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import PolicyError, load_tokenizer, remote_code_granted

    marker = tmp_path / "code-ran"
    planted = _model_with_its_own_code(tmp_path / "planted-model", marker)
    cfg = ModelConfig(policy=str(planted))
    monkeypatch.setenv("REDTEAM_GRPO_TRUST_REMOTE_CODE", str(tmp_path / "another-model"))
    assert not remote_code_granted(cfg)
    monkeypatch.setenv("REDTEAM_GRPO_TRUST_REMOTE_CODE", str(planted))
    assert remote_code_granted(cfg)
    hub = ModelConfig(policy="someone/model", revision="main")
    monkeypatch.setenv("REDTEAM_GRPO_TRUST_REMOTE_CODE", "someone/model@main")
    with pytest.raises(PolicyError, match="pinned commit"):
        remote_code_granted(hub)
    commit = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("REDTEAM_GRPO_TRUST_REMOTE_CODE", f"someone/model@{commit}")
    assert remote_code_granted(hub.model_copy(update={"revision": commit}))
    assert not remote_code_granted(ModelConfig(policy="someone/other", revision=commit))  # a transfer target
    # the command line's grant reaches the loader: the model's code runs (and is then the model's business)
    code, out = _cli("--trust-remote-code", str(planted), "config", "show")
    assert code == 0, out
    assert os.environ["REDTEAM_GRPO_TRUST_REMOTE_CODE"] == str(planted)
    load_tokenizer(cfg)
    with pytest.raises(Exception):  # noqa: B017  (the planted class cannot build a model: only its import matters)
        from redteam_grpo.core.models.policy import load_policy

        load_policy(cfg, 1.0, torch.device("cpu"), 0)
    assert marker.exists()


@pytest.mark.parametrize(
    ("key", "value"),
    [("reward", {"url": "http://10.0.0.9:50050"}), ("sampling", {"vllm_url": "http://attacker.example:8000"})],
)
def test_a_resume_whose_config_names_a_server_beyond_this_machine_asks_for_it_again(copy, key, value):
    """A resumed run sent your tokens and its texts to the servers its stored config names, written by whoever
    wrote the run folder: one beyond loopback must be named again on the command line."""
    stored = json.loads(copy.config_path.read_text())
    stored[key] |= value
    copy.config_path.write_text(json.dumps(stored))
    before = copy.manifest()
    setting, url = f"{'reward.url' if key == 'reward' else 'sampling.vllm_url'}", next(iter(value.values()))
    code, out = _cli("run", "--resume", copy.root, "--set", "run.iterations=3")
    _one_error_line(code, out, setting, url, f"--set {setting}=")
    assert copy.manifest() == before  # nothing ran
