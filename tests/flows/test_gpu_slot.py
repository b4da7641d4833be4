"""runtime.gpu_slot: a run holds one slot of a Prefect global concurrency limit from its first stage to its last,
so a second run waits for it; a limit that does not exist is an error naming the command that creates it."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.flows.runtime import RuntimeSetupError
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")


def _config(tmp_path, run_id, *extra):
    return load_config(
        None, [*SMALL_RUN, "run.iterations=1", f"run.runs_dir={tmp_path}", f"run.run_id={run_id}", *extra]
    ).model_dump(mode="json")


def _active_slots(name: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_a_run_holds_its_gpu_slot_and_a_second_run_waits_for_it(tmp_path):
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    held: list[int] = []
    attack.attack_run(
        config=_config(tmp_path, "a", f"runtime.gpu_slot={name}"),
        on_iteration=lambda m: held.append(_active_slots(name)),
    )
    assert held == [1] and _active_slots(name) == 0  # held while the run ran, given back after

    # while a holder keeps the only slot, a run does not start its stages
    from prefect.concurrency.sync import concurrency

    release = threading.Event()
    holding = threading.Event()

    def holder():
        with concurrency(name, occupy=1, strict=True):
            holding.set()
            release.wait(60)

    thread = threading.Thread(target=holder)
    thread.start()
    holding.wait(30)
    started: list[float] = []
    timer = threading.Timer(3.0, release.set)
    timer.start()
    begin = time.monotonic()
    attack.attack_run(
        config=_config(tmp_path, "b", f"runtime.gpu_slot={name}"),
        on_iteration=lambda m: started.append(time.monotonic()),
    )
    thread.join()
    assert started and started[0] - begin >= 3.0  # its first iteration ended after the holder let go


def test_a_gpu_slot_that_was_never_created_is_an_error_naming_the_command(tmp_path):
    with pytest.raises(RuntimeSetupError, match=r"prefect gcl create no-such-slot --limit"):
        attack.attack_run(config=_config(tmp_path, "c", "runtime.gpu_slot=no-such-slot"))
