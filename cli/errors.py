"""One line for a user's mistake or a damaged file: `error: <what is wrong and the way out>`, exit 2.

The project's own errors already say what is wrong and what to do; the library errors a person can cause (bad
JSON or YAML, a file that is not UTF-8, a full disk, a truncated Parquet or safetensors file, a model that is not
in the offline cache) are turned into such a line here. A traceback is printed only with `--verbose`, or for an
error this module does not know: that is a bug, and the traceback is what a bug report needs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

# Errors whose message is already the one line a person needs (each names the problem and the way out).
_PROJECT_ERRORS = (
    ("redteam_grpo.core.config", "ConfigError"),
    ("redteam_grpo.core.data.sources", "DataError"),
    ("redteam_grpo.core.capability", "CapabilityError"),
    ("redteam_grpo.core.models.policy", "PolicyError"),
    ("redteam_grpo.core.scoring.scorers", "ScorerError"),
    ("redteam_grpo.core.rollouts.sampling", "SamplingError"),
    ("redteam_grpo.core.training.train", "RatioCheckError"),
    ("redteam_grpo.core.training.train", "NonFiniteUpdateError"),
    ("redteam_grpo.core.training.staleness", "StaleRolloutsError"),
    ("redteam_grpo.storage.rundir", "RunDirError"),
    ("redteam_grpo.storage.schemas", "SchemaError"),
    ("redteam_grpo.storage.checkpoints", "CheckpointError"),
    ("redteam_grpo.storage.lineage", "LineageError"),
    ("redteam_grpo.storage.export", "ExportError"),
    ("redteam_grpo.tasks.evaluate", "EvaluationError"),
    ("redteam_grpo.core.models.quantization", "QuantizationError"),
    ("redteam_grpo.storage.hub", "HubError"),
    ("redteam_grpo.tasks.checkpoint", "AttackerError"),
    ("redteam_grpo.tasks.infer", "InferenceError"),
    ("redteam_grpo.tasks.train_step", "JoinError"),
    ("redteam_grpo.flows.runtime", "RuntimeSetupError"),
)
# Exit 1 rather than 2: the input was fine, a service was not; the run resumes from the stage that failed.
_SERVICE_ERRORS = (
    ("redteam_grpo.server.client", "RewardServiceError"),
    ("redteam_grpo.server.vllm_client", "SamplerError"),
    ("redteam_grpo.tasks.common", "ShardError"),
    ("redteam_grpo.tasks.distributed_update", "DistributedUpdateError"),
)


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    import importlib
    import sys

    found = []
    for module, name in names:
        if module in sys.modules or importlib.util.find_spec(module) is not None:
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def explain(exc: BaseException) -> tuple[str, int] | None:
    """(one line, exit code) for an error a person can cause or fix; None for a bug."""
    if isinstance(exc, _loaded(_SERVICE_ERRORS)):
        return str(exc), 1
    if isinstance(exc, _loaded(_PROJECT_ERRORS)):
        return str(exc), 2
    try:
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

        if isinstance(exc, LocalEntryNotFoundError):
            return (
                f"{exc}. The model is not in the local Hugging Face cache and runs are offline by default: download "
                "it first, or set run.offline=false",
                2,
            )
        if isinstance(exc, RepositoryNotFoundError | HFValidationError):
            return f"no such model or dataset on the hub: {exc}", 2
    except ImportError:
        pass
    if isinstance(exc, json.JSONDecodeError):
        return f"a JSON file is not valid JSON ({exc}); restore it, or start a new run", 2
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8", 2
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {exc.filename}" if exc.filename else ""
        return (
            f"no space left on the device{where}. Nothing half-written was kept: free space, then continue with "
            "`redteam-grpo run --resume RUN`",
            2,
        )
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return (f"{exc.strerror}: {exc.filename}" if exc.strerror else str(exc)), 2
    try:
        import pyarrow as pa

        if isinstance(exc, pa.ArrowInvalid):
            return f"a Parquet file cannot be read ({exc}); see `redteam-grpo run --resume RUN --redo ...`", 2
    except ImportError:
        pass
    if type(exc).__name__ == "SafetensorError":
        return f"a safetensors file is damaged or incomplete ({exc}); resume with --redo to rewrite it", 2
    return None


# How the project's messages name a run they cannot know (core and the reward client see no run folder); the CLI,
# which knows it, puts the real command in their place.
_RESUME_PLACEHOLDERS = ("redteam-grpo run --resume RUN_DIR", "redteam-grpo run --resume RUN")


def with_run_path(message: str, root: Any) -> str:
    """`message` with its placeholder resume command replaced by the real one for the run in `root`."""
    from redteam_grpo.storage.rundir import command_for

    command = f"redteam-grpo {command_for(root)} --resume {root}"
    for placeholder in _RESUME_PLACEHOLDERS:  # RUN_DIR first: RUN is its prefix
        message = message.replace(placeholder, command)
    return message


def name_the_run(exc: BaseException, root: Any) -> None:
    """Record on `exc` the run it stopped, for `user_errors` to name in the way out."""
    with contextlib.suppress(AttributeError):  # a type without a __dict__: the placeholder stays
        exc.run_root = root  # type: ignore[attr-defined]


def user_errors(command: F) -> F:
    """Wrap a CLI command: known errors become one `error:` line (a traceback too with `verbose=True`)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            explained = explain(exc)
            if explained is None:
                raise  # a bug: the traceback is what its report needs
            from rich.markup import escape

            from redteam_grpo.cli.main import console

            if kwargs.get("verbose"):
                console.print_exception()
            message, code = explained
            if getattr(exc, "run_root", None) is not None:
                message = with_run_path(message, exc.run_root)
            console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]


M = TypeVar("M")


def options_from_flags(model: type[M], flags: dict[str, str] | None = None, **values: Any) -> M:
    """`model(**values)` from a command's options; a value the model refuses is one `error:` line naming the option
    (`flags`: a field's option where it is not `--field-name`), exit 2."""
    from pydantic import ValidationError

    try:
        return model(**values)
    except ValidationError as exc:
        from redteam_grpo.cli.main import console

        names = flags or {}

        def option(loc: tuple) -> str:
            return names.get(str(loc[0]), "--" + "-".join(map(str, loc)).replace("_", "-"))

        problems = "; ".join(f"{option(e['loc'])}: {e['msg']}" for e in exc.errors())
        console.print(f"[red]error:[/red] {problems}")
        raise typer.Exit(2) from None
