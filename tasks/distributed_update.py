"""The train step data-parallel over `training.nproc` processes started by torchrun (training.launcher=torchrun).

The stage (`tasks/train_step.py`) runs

    python -m torch.distributed.run --standalone --nproc-per-node N -m redteam_grpo.tasks.distributed_update \\
        RUN_DIR ITERATION ROLE RESULT_JSON

and waits. Every process loads the policy and the weights after iteration - 1 from the run directory, reads the
whole batch and computes its share of the micro-batches (`core/training/distributed.py`: gradients and statistics summed
over the group, so every process takes the same step); rank 0 writes the adapter and optimizer into the
iteration's checkpoint folder (atomically) and the update's statistics to RESULT_JSON. The stage then records
the files as a single-process step would. One process per GPU (NCCL), or gloo on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from redteam_grpo.core.training.train import NonFiniteUpdateError, RatioCheckError, UpdateStats
from redteam_grpo.storage.atomic import write_json_atomic
from redteam_grpo.storage.location import absolute
from redteam_grpo.storage.rundir import DamagedRunError, RunDir, RunDirError
from redteam_grpo.storage.stages import LEARNERS, Learner

STOP_GRACE_S = 30.0  # how long the processes get to end after SIGTERM before SIGKILL


class DistributedUpdateError(RuntimeError):
    """The torchrun processes of a train step failed; the message holds the error and the log's last lines."""


def _reraised() -> dict[str, type[Exception]]:
    """Errors a worker reports by name that the stage raises again as themselves (the CLI explains them)."""
    from redteam_grpo.core.models.policy import PolicyError
    from redteam_grpo.storage.checkpoints import CheckpointError
    from redteam_grpo.storage.schemas import SchemaError
    from redteam_grpo.tasks.train_step import JoinError

    errors = (
        RatioCheckError,
        NonFiniteUpdateError,
        DamagedRunError,
        RunDirError,
        CheckpointError,
        PolicyError,
        SchemaError,
        JoinError,
    )
    return {error.__name__: error for error in errors}


def _stop(process: subprocess.Popen) -> None:
    """End torchrun and its workers (their own process group): SIGTERM, then SIGKILL after STOP_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(run: RunDir, iteration: int, learner: Learner, nproc: int) -> UpdateStats:
    """Run the update of `learner` for `iteration` in `nproc` torchrun processes; their statistics. The weights are
    in the checkpoint folder when it returns. A stop (SIGTERM, SIGINT) ends the processes before it propagates."""
    from redteam_grpo.core.models.policy import resolve_device

    if resolve_device(run.stored_config().run.device).type == "cuda" and torch.cuda.device_count() < nproc:
        raise DistributedUpdateError(
            f"training.nproc={nproc} processes need {nproc} GPUs, this machine has {torch.cuda.device_count()}: lower "
            "training.nproc (or set training.launcher=single)"
        )
    with tempfile.TemporaryDirectory(prefix="redteam-grpo-torchrun-") as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "torchrun.log"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "redteam_grpo.tasks.distributed_update",
            str(absolute(run.root)),
            str(iteration),
            learner.role,
            str(result),
        ]
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = process.wait()
            except BaseException:
                _stop(process)  # the workers must not outlive the stage, nor write weights after it
                raise
        answer = json.loads(result.read_text()) if result.is_file() else None
        if returncode == 0 and answer is not None and "stats" in answer:
            return UpdateStats(**answer["stats"])
        known = _reraised()
        if answer is not None and answer.get("error") in known:
            raise known[answer["error"]](answer["message"])
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        first = f" ({answer['error']}: {answer['message']})" if answer is not None and "error" in answer else ""
        raise DistributedUpdateError(
            f"the train step's {nproc} torchrun processes failed (exit {returncode}){first}; nothing was recorded: "
            f"resume the run to try again, or set training.launcher=single. The log's last lines:\n{tail}"
        )


def main(run_dir: str, iteration: int, role: str, result: Path) -> None:
    import torch.distributed as dist

    from redteam_grpo.core.models.policy import resolve_device
    from redteam_grpo.core.training.distributed import DataParallel
    from redteam_grpo.tasks.resources import resources_for
    from redteam_grpo.tasks.train_step import save_update, update_in_memory

    use_cuda = resolve_device(RunDir.open(run_dir).stored_config().run.device).type == "cuda"
    if use_cuda:  # one GPU per process: "cuda" below means this one
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    data_parallel = DataParallel.current()
    learner = LEARNERS[role]
    try:
        res = resources_for(run_dir)
        update = update_in_memory(res, iteration, learner, data_parallel)
        if data_parallel.rank == 0:
            folder = res.run.checkpoint_dir(iteration)
            save_update(res, learner, [folder / learner.adapter_file, folder / learner.optimizer_file])
            write_json_atomic(result, {"stats": dataclasses.asdict(update)})
    except Exception as exc:
        if data_parallel.rank == 0:
            write_json_atomic(result, {"error": type(exc).__name__, "message": str(exc)})
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
