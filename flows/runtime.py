"""Where an iteration's stages run, on engines the lab already has (runtime section of the config).

- Ray, through prefect-ray: an iteration is a subflow run whose task runner is a `RayTaskRunner`, so the sample and
  score shards (`tasks/common.py: run_sharded_stage`) run as Prefect tasks on Ray workers. The run joins the cluster at
  `runtime.ray_address`, or starts a local instance once for the whole run (not once per iteration).
- A GPU slot: a Prefect global concurrency limit (`prefect gcl create NAME --limit GPUS`), one slot of which the
  run holds from its first to its last stage, so two scheduled runs do not share a GPU.
- torchrun for the train step is `tasks/distributed_update.py` (training.launcher).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

from redteam_grpo.core.config import Config, RuntimeConfig
from redteam_grpo.core.models.policy import resolve_device
from redteam_grpo.tasks.logs import stage_logger


class RuntimeSetupError(RuntimeError):
    """The engine the runtime section names cannot be used; the message says how to fix it."""


def _require_ray() -> Any:
    try:
        import prefect_ray
        import ray
    except ImportError:
        raise RuntimeSetupError(
            "runtime.task_runner=ray needs Ray and prefect-ray: pip install 'redteam-grpo[ray]' (or set "
            "runtime.task_runner=local)"
        ) from None
    return ray, prefect_ray


def iteration_runner(runtime: RuntimeConfig) -> Any:
    """What runs one iteration: a nested task run where the shards run in this process, a subflow run whose task
    runner is prefect-ray's where they run on Ray (flows/iteration.py)."""
    from redteam_grpo.flows.iteration import iteration_flow, iteration_task

    if runtime.task_runner != "ray":
        return iteration_task
    _, prefect_ray = _require_ray()
    return iteration_flow.with_options(task_runner=prefect_ray.RayTaskRunner(address=runtime.ray_address))


def _check_reachable(address: str) -> None:
    """Fail at once on a Ray address nothing listens at (Ray itself retries for minutes); `auto` is Ray's to find."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except (OSError, ValueError) as exc:
        raise RuntimeSetupError(
            f"nothing answers at runtime.ray_address={address!r} ({exc}): start the cluster (`ray start --head`), "
            "fix the address (ray://HOST:10001 or HOST:6379), or unset it to start a local Ray instance"
        ) from None


@contextlib.contextmanager
def ray_session(runtime: RuntimeConfig) -> Iterator[None]:
    """Connect to the Ray cluster (or start a local instance) for the duration of the run; a no-op for `local`.
    The task runner of each iteration then finds Ray initialised and leaves it running."""
    if runtime.task_runner != "ray":
        yield
        return
    ray, _ = _require_ray()
    if ray.is_initialized():  # a caller (a test, a notebook) started it: theirs to stop
        yield
        return
    options: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,  # workers' output stays in Ray's logs; task logs go to the Prefect API
        "logging_level": logging.ERROR,  # Ray's start-up notices are not the run's news
        "namespace": "prefect",
    }
    if runtime.ray_address is None:
        options["num_cpus"] = runtime.ray_num_cpus
    else:
        _check_reachable(runtime.ray_address)
    try:
        ray.init(runtime.ray_address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = (
            f"join the Ray cluster at runtime.ray_address={runtime.ray_address!r}"
            if runtime.ray_address
            else "start a local Ray instance"
        )
        raise RuntimeSetupError(
            f"cannot {where} ({exc}): start the cluster (`ray start --head`), fix runtime.ray_address, or set "
            "runtime.task_runner=local"
        ) from None
    resources = ray.cluster_resources()
    stage_logger().info(
        "Ray: %s, %d CPUs, %d GPUs",
        runtime.ray_address or "local instance",
        int(resources.get("CPU", 0)),
        int(resources.get("GPU", 0)),
    )
    try:
        yield
    finally:
        ray.shutdown()


def check_runtime(cfg: Config) -> None:
    """Refuse a runtime that would run the stages other than asked, before anything runs."""
    runtime = cfg.runtime
    if runtime.task_runner == "ray" and runtime.shard_gpus == 0 and resolve_device(cfg.run.device).type == "cuda":
        raise RuntimeSetupError(
            "the run uses a GPU but runtime.shard_gpus is 0: Ray would start the shards without a GPU of their own "
            "(on the CPU, or all on the first GPU). Set runtime.shard_gpus=1 (0.5: two shards per GPU), or "
            "run.device=cpu"
        )


@contextlib.contextmanager
def gpu_slot(runtime: RuntimeConfig, gpus: int = 1) -> Iterator[None]:
    """Hold `gpus` slots of the global concurrency limit `runtime.gpu_slot` (waiting for them) while the block runs."""
    if runtime.gpu_slot is None:
        yield
        return
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency

    stage_logger().info("waiting for %d slot(s) of the concurrency limit %r", gpus, runtime.gpu_slot)
    with contextlib.ExitStack() as stack:
        try:
            # a lost lease renewal (an API blip) must not kill a long run: the slot is only bookkeeping
            stack.enter_context(
                concurrency(runtime.gpu_slot, occupy=gpus, strict=True, raise_on_lease_renewal_failure=False)
            )
        except ConcurrencySlotAcquisitionError as exc:
            raise RuntimeSetupError(
                f"cannot take a slot of runtime.gpu_slot={runtime.gpu_slot!r} ({exc}). If the global concurrency "
                f"limit does not exist, create it with `prefect gcl create {runtime.gpu_slot} --limit GPUS` (or unset "
                "runtime.gpu_slot)"
            ) from None
        stage_logger().info("holding a slot of %r", runtime.gpu_slot)
        yield
