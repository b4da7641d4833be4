"""The train step data-parallel over `training.nproc` processes started by torchrun (training.launcher=torchrun).

The stage (`tasks/train_step.py`) runs

    python -m torch.distributed.run --standalone --nproc-per-node N -m redteam_grpo.tasks.distributed_update \\
        RUN_DIR ITERATION ROLE RESULT_JSON

and waits. Every process loads the policy and the weights after iteration - 1 from the run directory, reads the
whole batch and computes its share of the micro-batches (`core/distributed.py`: gradients and statistics summed
over the group, so every process takes the same step); rank 0 writes the adapter and optimizer into the
iteration's checkpoint folder (atomically) and the update's statistics to RESULT_JSON. The stage then records
the files as a single-process step would. One process per GPU (NCCL), or gloo on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from redteam_grpo.core.train import RatioCheckError, UpdateStats
from redteam_grpo.storage.atomic import write_json_atomic
from redteam_grpo.storage.rundir import DamagedRunError, RunDir, RunDirError
from redteam_grpo.storage.stages import ATTACKER_LEARNER, POLICY, Learner

LEARNERS = {learner.role: learner for learner in (POLICY, ATTACKER_LEARNER)}
# Errors a worker reports by name, raised again by the stage as themselves (the CLI explains them).
_RERAISED = {error.__name__: error for error in (RatioCheckError, DamagedRunError, RunDirError)}


class DistributedUpdateError(RuntimeError):
    """The torchrun processes of a train step failed; the message holds the first error and where the log is."""


def launch(run: RunDir, iteration: int, learner: Learner, nproc: int) -> UpdateStats:
    """Run the update of `learner` for `iteration` in `nproc` torchrun processes; their statistics. The weights are
    in the checkpoint folder when it returns."""
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
            str(run.root.resolve()),
            str(iteration),
            learner.role,
            str(result),
        ]
        with log.open("w") as out:
            finished = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
        answer = json.loads(result.read_text()) if result.is_file() else None
        if answer is not None and "error" in answer:
            raise _RERAISED.get(answer["error"], DistributedUpdateError)(answer["message"])
        if finished.returncode != 0 or answer is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise DistributedUpdateError(
                f"the train step's {nproc} torchrun processes failed (exit {finished.returncode}); nothing was "
                f"recorded, resume the run to try again, or set training.launcher=single. Last lines:\n{tail}"
            )
    return UpdateStats(**answer["stats"])


def main(run_dir: str, iteration: int, role: str, result: Path) -> None:
    import torch.distributed as dist

    from redteam_grpo.core.distributed import DataParallel
    from redteam_grpo.core.policy import resolve_device
    from redteam_grpo.tasks.resources import resources_for
    from redteam_grpo.tasks.train_step import save_update, update_in_memory

    use_cuda = resolve_device(RunDir.open(Path(run_dir)).stored_config().run.device).type == "cuda"
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
