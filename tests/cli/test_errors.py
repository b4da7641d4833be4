import errno

import pytest
import typer

from redteam_grpo.cli.errors import explain, user_errors
from redteam_grpo.storage.rundir import DamagedRunError


def test_a_full_disk_is_one_line_with_the_way_out():
    message, code = explain(OSError(errno.ENOSPC, "No space left on device", "/runs/r/iter_0003/.tmp-1-x"))
    assert code == 2 and "no space left" in message and "/runs/r/iter_0003" in message and "--resume" in message


def test_a_damaged_safetensors_file_and_a_model_missing_offline_are_explained():
    from huggingface_hub.errors import LocalEntryNotFoundError
    from safetensors import SafetensorError

    assert "damaged or incomplete" in explain(SafetensorError("incomplete metadata"))[0]
    assert "run.offline=false" in explain(LocalEntryNotFoundError("Qwen/Qwen3-4B not cached"))[0]


def test_project_errors_pass_through_and_bugs_keep_their_traceback():
    assert explain(DamagedRunError("x is missing; redo")) == ("x is missing; redo", 2)
    assert explain(ZeroDivisionError("bug")) is None

    @user_errors
    def command(verbose: bool = False):
        raise DamagedRunError("the file [iter_0001] is missing")

    with pytest.raises(typer.Exit) as exit_info:
        command()
    assert exit_info.value.exit_code == 2

    @user_errors
    def buggy():
        raise ZeroDivisionError("bug")

    with pytest.raises(ZeroDivisionError):
        buggy()


def test_a_way_out_that_names_a_placeholder_run_names_the_run_that_stopped(tmp_path, monkeypatch):
    """The reward client and the trainer cannot know the run's folder; the CLI puts it in their resume command."""
    import io

    from rich.console import Console

    from redteam_grpo.cli import main
    from redteam_grpo.cli.errors import name_the_run
    from redteam_grpo.server.client import RewardServiceError

    printed = io.StringIO()
    monkeypatch.setattr(main, "console", Console(file=printed, width=1000))

    root = tmp_path / "runs" / "r1"
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"run": {"mode": "defense"}}')

    @user_errors
    def command(verbose: bool = False):
        exc = RewardServiceError("the reward server failed 2 times (`redteam-grpo run --resume RUN_DIR`)")
        name_the_run(exc, root)
        raise exc

    with pytest.raises(typer.Exit) as exit_info:
        command()
    assert exit_info.value.exit_code == 1
    out = printed.getvalue()
    assert f"(`redteam-grpo defense --resume {root}`)" in out and "RUN_DIR" not in out
