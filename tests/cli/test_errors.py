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
