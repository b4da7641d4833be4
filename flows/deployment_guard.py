"""What a deployment's caller may ask for (SECURITY.md): whoever can create a flow run on the Prefect API is not the
person who set up the worker. A flow run of a deployment takes its config from a file of the deployed folder and
`key=value` overrides of the run's settings, never:

- where runs are written or which servers and clusters the run talks to (`run.runs_dir`, `runtime.ray_address`
  (a cluster whose replies Ray unpickles), `sampling.vllm_url`, `reward.url`): the worker's working directory and
  the deployment's config file say these;
- a config file outside the deployed folder, or a URL of a scheme other than `file` in any value;
- a run to resume, or evaluate, outside the runs folder its config names;
- a callable (`on_iteration`: the CLI's progress display).

The worker's environment may widen it: REDTEAM_GRPO_DEPLOYMENT_ALLOW names denied settings callers may set after
all (comma-separated, e.g. `run.runs_dir`), REDTEAM_GRPO_DEPLOYMENT_URL_SCHEMES the URL schemes they may name (e.g.
`s3,hf`). The CLI, which runs these flows in its own process, is not a deployment and is not checked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from prefect.context import FlowRunContext

from redteam_grpo.core.config import ConfigError, load_config
from redteam_grpo.core.names import is_component
from redteam_grpo.storage.location import absolute, location, same_place
from redteam_grpo.storage.rundir import RunDir

DENIED = ("run.runs_dir", "runtime.ray_address", "sampling.vllm_url", "reward.url", "model.trust_remote_code")
ALLOW_ENV = "REDTEAM_GRPO_DEPLOYMENT_ALLOW"
SCHEMES_ENV = "REDTEAM_GRPO_DEPLOYMENT_URL_SCHEMES"
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def from_a_deployment() -> bool:
    """Whether this flow run itself was created through a deployment (by whoever can reach the Prefect API). A flow
    it calls (retrain's run) is not: its parameters come from this code, already checked.
    PREFECT__RUNTIME__DEPLOYMENT__ID stands for a deployment, as Prefect's runtime lets it (tests)."""
    if os.environ.get("PREFECT__RUNTIME__DEPLOYMENT__ID"):
        return True
    context = FlowRunContext.get()
    return context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None


def _listed(variable: str) -> set[str]:
    return {item.strip() for item in os.environ.get(variable, "").split(",") if item.strip()}


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and not prefix:  # sections; a setting's own dict value is one value
            flat |= _flatten(value, f"{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _check_setting(key: str, value: Any) -> None:
    allowed = _listed(ALLOW_ENV)
    if key in DENIED and key not in allowed:
        raise ConfigError(
            f"a deployment's caller may not set {key}: where runs go and which servers a run talks to come from the "
            f"worker's config file (or allow it on the worker: {ALLOW_ENV}={key})"
        )
    schemes = _listed(SCHEMES_ENV) | {"file"}
    for scheme in _URL.findall(str(value)):
        if scheme.lower() not in schemes:
            raise ConfigError(
                f"{key}: a deployment's caller may not name a {scheme}:// URL (allow the scheme on the worker: "
                f"{SCHEMES_ENV}={scheme.lower()})"
            )


def _check_config_path(config_path: str) -> None:
    path = Path(config_path)
    if path.is_absolute() or ".." in path.parts or path.suffix not in CONFIG_SUFFIXES:
        raise ConfigError(
            f"config_path {config_path}: a deployment reads a config file of the deployed folder only (a relative "
            f"path without '..', ending {', '.join(CONFIG_SUFFIXES)})"
        )


def _check_inside_runs(run_dir: str, runs_dir: str, what: str) -> None:
    """A run folder directly inside `runs_dir` as the file system resolves it: `runs/..` or a link out of the runs
    folder is refused."""
    folder = location(run_dir)
    if not is_component(folder.name) or not same_place(str(absolute(folder).parent), runs_dir):
        raise ConfigError(f"{what} {run_dir}: a deployment may only {what} a run of its runs folder {runs_dir}")


def check_run_request(
    config: dict[str, Any] | None,
    config_path: str | None,
    overrides: list[str] | None,
    resume: str | None,
    on_iteration: Any = None,
) -> None:
    """Refuse what a deployment's caller may not ask of a run flow (the module's docstring), before anything runs."""
    if on_iteration is not None:
        raise ConfigError("on_iteration is the command line's progress display: a deployment run takes none")
    if config_path:
        _check_config_path(config_path)
    for key, value in _flatten(config or {}).items():
        _check_setting(key, value)
    for override in overrides or []:
        key, _, value = str(override).partition("=")
        _check_setting(key.strip(), value)
    if resume is not None:
        runs_dir = load_config(Path(config_path) if config_path else None, list(overrides or [])).run.runs_dir
        _check_inside_runs(resume, runs_dir, "resume")
        address = RunDir.open(resume).stored_config().runtime.ray_address
        if address is not None and "runtime.ray_address" not in _listed(ALLOW_ENV):
            raise ConfigError(
                f"resume {resume}: the run names the Ray cluster {address}, which a deployment's caller may not "
                f"choose; resume it from the command line (allow it on the worker: {ALLOW_ENV}=runtime.ray_address)"
            )


def check_evaluation_request(run_dir: str, against: str | None = None) -> None:
    """An evaluation writes into the run it evaluates, and reads the run it is set `against`: each one of the runs
    folder of the worker's default config (any, where the worker lets callers choose the runs folder)."""
    if "run.runs_dir" not in _listed(ALLOW_ENV):
        runs_dir = load_config(None, []).run.runs_dir
        _check_inside_runs(run_dir, runs_dir, "evaluate")
        if against is not None:
            _check_inside_runs(against, runs_dir, "evaluate --against")
