"""Where an iteration's stages run, on engines the lab already has (runtime section of the config).

- Ray, through prefect-ray: the iteration subflow's task runner is a `RayTaskRunner`, so the sample and score
  shards (`tasks/common.py: run_sharded_stage`) run as Prefect tasks on Ray workers. The run joins the cluster at
  `runtime.ray_address`, or starts a local instance once for the whole run (not once per iteration).
- A GPU slot: a Prefect global concurrency limit (`prefect gcl create NAME --limit GPUS`), one slot of which the
  run holds from its first to its last stage, so two scheduled runs do not share a GPU.
- torchrun for the train step is `tasks/distributed_update.py` (training.launcher).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from redteam_grpo.core.config import RuntimeConfig
from redteam_grpo.tasks.logs import stage_logger


class RuntimeSetupError(RuntimeError):
    """The engine the runtime section names cannot be used; the message says how to fix it."""


def iteration_flow_for(iteration_flow: Any, runtime: RuntimeConfig) -> Any:
    """The iteration subflow with the task runner its shards run on."""
    if runtime.task_runner != "ray":
        return iteration_flow
    from prefect_ray import RayTaskRunner

    return iteration_flow.with_options(task_runner=RayTaskRunner(address=runtime.ray_address))


@contextlib.contextmanager
def ray_session(runtime: RuntimeConfig) -> Iterator[None]:
    """Connect to the Ray cluster (or start a local instance) for the duration of the run; a no-op for `local`.
    The task runner of each iteration then finds Ray initialised and leaves it running."""
    if runtime.task_runner != "ray":
        yield
        return
    try:
        import ray
    except ImportError:
        raise RuntimeSetupError(
            "runtime.task_runner=ray needs Ray and prefect-ray: pip install 'redteam-grpo[ray]'"
        ) from None
    if ray.is_initialized():  # a caller (a test, a notebook) started it: theirs to stop
        yield
        return
    options: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,  # workers' output stays in Ray's logs; task logs go to the Prefect API
        "logging_level": logging.WARNING,
        "namespace": "prefect",
    }
    if runtime.ray_address is None:
        options["num_cpus"] = runtime.ray_num_cpus
    try:
        ray.init(runtime.ray_address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RuntimeSetupError(
            f"cannot join the Ray cluster at runtime.ray_address={runtime.ray_address!r} ({exc}); start it "
            "(`ray start --head`) or unset runtime.ray_address to start a local instance"
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


@contextlib.contextmanager
def gpu_slot(runtime: RuntimeConfig) -> Iterator[None]:
    """Hold one slot of the global concurrency limit `runtime.gpu_slot` (waiting for one) while the block runs."""
    if runtime.gpu_slot is None:
        yield
        return
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency

    stage_logger().info("waiting for a slot of the concurrency limit %r", runtime.gpu_slot)
    with contextlib.ExitStack() as stack:
        try:
            # a lost lease renewal (an API blip) must not kill a long run: the slot is only bookkeeping
            stack.enter_context(
                concurrency(runtime.gpu_slot, occupy=1, strict=True, raise_on_lease_renewal_failure=False)
            )
        except ConcurrencySlotAcquisitionError as exc:
            raise RuntimeSetupError(
                f"runtime.gpu_slot={runtime.gpu_slot!r} names no global concurrency limit of the Prefect API "
                f"({exc}). Create it with `prefect gcl create {runtime.gpu_slot} --limit GPUS` (or unset "
                "runtime.gpu_slot)"
            ) from None
        stage_logger().info("holding a slot of %r", runtime.gpu_slot)
        yield
