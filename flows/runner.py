"""The run every mode shares: the config asked for (`requested_config`), the run directory owned and resumed
(`owned_run`: the lock, leftover temporary files, `--redo`, every recorded file verified), and the parent loop
(`run_iterations`): one iteration run (flows/iteration.py: a nested task run, or a subflow run on Ray) for each
iteration not yet sealed, each running its mode's stages (storage/modes.py: `Mode.stages`), then early stopping and
the run's status. A mode's flow (flows/attack.py, flows/defense.py, flows/sft.py) is `run_mode` with its record.

Each stage reads the previous stage's Parquet file and writes its own (see storage/schemas.py); the run's
manifest records completed stages, so a resumed run continues from the first stage that did not complete.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect.exceptions import TerminationSignal
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from redteam_grpo.core.config import (
    RESUMABLE_CHANGES,
    Config,
    ConfigError,
    load_config,
    merged_config,
    validate_config,
)
from redteam_grpo.core.data.sources import Prompt, check_prompt_lengths, load_prompts
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import check_model_available, load_tokenizer
from redteam_grpo.core.models.roles import ATTACKER
from redteam_grpo.core.scoring.backend import preflight
from redteam_grpo.core.training.stopping import early_stop
from redteam_grpo.flows.deployment_guard import check_run_request, from_a_deployment
from redteam_grpo.flows.runtime import check_runtime, gpu_slot, iteration_runner, ray_session
from redteam_grpo.storage import checkpoints, interrupts, ownership
from redteam_grpo.storage.lineage import read_lineage, record_in_manifest, start_in_lineage
from redteam_grpo.storage.modes import Mode, mode_of
from redteam_grpo.storage.rundir import INIT_VERSION, RunDir, RunDirError, new_run_id, parse_redo
from redteam_grpo.tasks.artifacts import PUBLISHER
from redteam_grpo.tasks.checkpoint import attacker_system_prompt, initialize_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import forget


def models_in_use(cfg: Config) -> list[tuple[str, str]]:
    """(setting, model name) of every model a run of this config loads."""
    from redteam_grpo.core.scoring.novelty import PACKAGED_MINILM

    mode = mode_of(cfg)
    models = [("model.policy", cfg.model.policy)]
    if mode.data != "pairs":  # SFT scores nothing
        models.append(("reward.scorer", cfg.reward.scorer))
        if cfg.reward.refusal_classifier is not None:
            models.append(("reward.refusal_classifier", cfg.reward.refusal_classifier))
    if ATTACKER in mode.learning_roles(cfg) and cfg.reward.embedder != PACKAGED_MINILM:  # its novelty's
        models.append(("reward.embedder", cfg.reward.embedder))
    return models


def check_inputs(cfg: Config, run: RunDir | None = None) -> None:
    """Every check of what a run will read, before any model loads: each model it names can be loaded (a folder,
    or a hub id in the local cache when offline), the prompt source loads and every prompt fits
    model.max_prompt_tokens after chat formatting (not only the ones drawn first, iterations later), the scorer's
    labels name reward.toxic_label and reward.refusal_label (when it scores in this process). With an
    attacker (defense) the prompts are its goals, formatted with its system prompt; SFT's data are pairs, of which
    the inputs are checked."""
    for setting, name in models_in_use(cfg):
        check_model_available(setting, name, cfg.model.revision if setting == "model.policy" else None)
    mode = mode_of(cfg)
    if mode.data != "pairs" and not cfg.reward.urls:  # scored here: its labels are read from its config alone
        preflight(cfg.reward)
    if mode.data == "pairs":
        from redteam_grpo.tasks.sft import training_pairs

        prompts = [Prompt(p.pair_id, p.input_text) for p in training_pairs(cfg)]
    else:
        prompts = load_prompts(cfg.data)
    system_prompt = _attacker_prompt(cfg, run) if ATTACKER in mode.roles else cfg.model.system_prompt
    tokenizer = load_tokenizer(cfg.model)
    prompt_ids = [format_prompt_ids(tokenizer, p.text, system_prompt) for p in prompts]
    check_prompt_lengths(prompts, prompt_ids, cfg.model.max_prompt_tokens)


def _attacker_prompt(cfg: Config, run: RunDir | None) -> str:
    """The system prompt the attacker formats goals with: as the run recorded it when it started (a resumed defense
    run has its attacker in its initial checkpoint, wherever defense.attacker has gone since), else as it will be."""
    if run is not None:
        try:
            return checkpoints.read_manifest(run.checkpoint_dir(INIT_VERSION))["attacker"]["system_prompt"]
        except (checkpoints.CheckpointError, KeyError):
            pass  # not started far enough to have recorded it
    return attacker_system_prompt(cfg)


@contextlib.contextmanager
def owned_run(config: Config | None, resume: str | Path | None, redo: str | None, mode: Mode) -> Iterator[RunDir]:
    """A new run directory for `config`, or the one to resume (its config checked against `config`), owned by
    this process for the duration of the block (storage/ownership.py): a second process is refused at once.

    Everything that writes into the folder happens under the lock: its creation, the clean-up of temporary
    files that interrupted writes left, a resumed config, the lineage record (storage/lineage.py). A new run's
    data is checked before its folder exists; a resumed run first checks every file it recorded, so it never
    builds on a damaged one, then its data and models as a new run's; `redo` (`7` or `7/score`) drops that stage,
    the rest of its iteration and every later iteration, to be computed again.
    """
    log = stage_logger()
    if resume is None:
        if redo is not None:
            raise RunDirError("--redo needs --resume RUN: it recomputes part of an existing run")
        config = with_run_id(config or validate_config(mode.defaults()))
        check_inputs(config)  # before the run directory exists: a bad input leaves nothing behind
        root = RunDir.root_for(config)
        RunDir.check_creatable(root)  # refuse before leaving a lock file in someone else's folder
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = RunDir.open(resume).root  # a run directory, before its lock is taken
    with ownership.owning(root):
        if resume is None:
            run = RunDir.create(config)
        else:
            run = RunDir.open(root)
            removed = run.remove_temporary_files()
            if removed:
                log.info("run %s: removed %d temporary files left by interrupted writes", run.run_id, removed)
            resumed = run.check_resume_config(config, RESUMABLE_CHANGES)
            if redo is not None:
                redo_from = parse_redo(redo)
                run.check_redo(*redo_from)
                dropped = run.forget_from(*redo_from)
                log.warning("redo %s: %d recorded stages will be computed again", redo, len(dropped))
            run.verify_all()
            check_inputs(resumed, run)  # the data may have moved since the run started: say so before a model loads
            run.store_resumed_config(resumed)  # only now: a refused resume changes nothing on disk
        lineage = run.stored_config().run.lineage
        if lineage is not None:
            record = read_lineage(run)
            if record is None:
                start_in_lineage(run, lineage)
            elif run.identity_and_status().get("lineage") is None:
                record_in_manifest(run, record)
        yield run


def without_heartbeats() -> contextlib.AbstractContextManager:
    """Settings under which a subflow run (an iteration on Ray) sends no heartbeats of its own. The parent flow
    run's heartbeats already tell whether the process lives; a subflow run's heartbeat thread sleeps in 1 s steps
    and is joined when the run ends, which costs each iteration about a second in Prefect 3.8. A crash then leaves
    the iteration's run as it was, and marks the parent's."""
    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def with_run_id(config: Config) -> Config:
    """`config` with its run id chosen (from run.name and the time) if it names none, so the folder is known."""
    if config.run.run_id is not None:
        return config
    return config.model_copy(update={"run": config.run.model_copy(update={"run_id": new_run_id(config.run.name)})})


def requested_config(
    config: dict[str, Any] | None,
    config_path: str | None,
    overrides: list[str] | None,
    resume: str | Path | None,
    mode: Mode,
) -> Config | None:
    """The config asked for: a nested dict, or a YAML file and/or `key=value` overrides (not both ways), over the
    defaults of `mode` (the flow's). When a run is resumed, the file and overrides change its stored config, not
    the defaults; a resumed run must be of the flow's mode."""
    if config is not None and (config_path or overrides):
        raise ConfigError("give either config (a dict) or config_path/overrides, not both")
    stored = RunDir.open(resume).stored_config() if resume is not None else None
    if stored is not None and mode_of(stored) is not mode:
        command = mode_of(stored).command
        raise ConfigError(f"{resume} is a {stored.run.mode} run: resume it with `redteam-grpo {command}`")
    requested = None
    if config is not None:
        requested = validate_config(merged_config(mode.defaults(), config))
    elif config_path or overrides:
        base = stored.model_dump(mode="json") if stored is not None else None
        requested = load_config(Path(config_path) if config_path else None, list(overrides or []), base, mode.name)
    if requested is not None and mode_of(requested) is not mode:
        raise ConfigError(
            f"run.mode is {requested.run.mode}, but this is the {mode.name} flow: run it with "
            f"`redteam-grpo {mode_of(requested).command}` (or leave run.mode out)"
        )
    return requested


# What a stop signal raises in a flow: Prefect's SIGTERM handler TerminationSignal, Python's SIGINT handler
# KeyboardInterrupt. The CLI raises the same from its own handlers (cli/signals.py).
STOP_EXCEPTIONS = (TerminationSignal, KeyboardInterrupt)


def stop_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else TerminationSignal(signal=signum)


def stop_behind(exc: BaseException) -> BaseException | None:
    """The stop exception `exc` is, or was raised while handling: a Ctrl-C to the process group stops Prefect's
    API server too, and a stop that reaches Prefect's engine can come back as the connection error its report of
    the crash then raised, the stop as its context. None for a failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, STOP_EXCEPTIONS):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def signal_of(stop: BaseException) -> int:
    return stop.signal if isinstance(stop, TerminationSignal) else signal.SIGINT


def _stopped(run: RunDir, iteration: int, cfg: Config, metrics: dict[str, float] | None = None) -> bool:
    """Decide early stopping from the iteration's metrics row; record the stop's kind and reason if so."""
    mode = mode_of(cfg)
    if not mode.early_stopping:
        return False  # SFT runs its epochs
    stop = early_stop(metrics or run.read(mode.metrics, iteration).to_pylist()[0], cfg.run)
    if stop is None:
        return False
    stage_logger().warning("early stop after iteration %d: %s", iteration, stop.message)
    run.set_status("early_stopped", stop_kind=stop.kind, stop_reason=stop.message)
    return True


def run_mode(
    mode: Mode,
    config: dict[str, Any] | None,
    resume: str | None,
    config_path: str | None,
    overrides: list[str] | None,
    on_iteration: Any,
    redo: str | None,
) -> str:
    """What every mode's run flow does: the config asked for, the run directory owned, its iterations run. A
    deployment's caller asks for less than the command line (flows/deployment_guard.py)."""
    if from_a_deployment():
        check_run_request(config, config_path, overrides, resume, on_iteration)
    requested = requested_config(config, config_path, overrides, resume, mode)
    with owned_run(requested, resume, redo, mode) as run:
        return run_iterations(run, on_iteration)


def run_iterations(run: RunDir, on_iteration: Any) -> str:
    """The parent loop every mode shares: one iteration run (`iteration_runner`: it returns the iteration's metrics
    row) for each iteration not yet sealed, early stopping, and the run's status."""
    cfg = run.stored_config()
    log = stage_logger()
    done = run.completed_iterations()
    start = done[-1] + 1 if done else 0
    log.info("run %s: iterations %d..%d in %s", run.run_id, start, cfg.run.iterations - 1, run.root)
    run.set_status("running")
    check_runtime(cfg)
    _, synchronous_because = mode_of(cfg).staleness(cfg)
    if synchronous_because is not None:
        log.warning(synchronous_because)
    iteration = iteration_runner(cfg.runtime)
    gpus = cfg.training.nproc if cfg.training.launcher == "torchrun" else 1  # the train step's GPUs, on this machine
    try:
        with gpu_slot(cfg.runtime, gpus), ray_session(cfg.runtime):
            initialize_stage(str(run.root))
            if done and _stopped(run, done[-1], cfg):  # stopped in the last process, before its status was written
                return str(run.root)
            # without_heartbeats entered once: each entry rebuilds Prefect's settings (~30 ms)
            with without_heartbeats(), PUBLISHER.publishing():
                for number in range(start, cfg.run.iterations):
                    metrics = iteration(str(run.root), run.run_id, number)
                    if on_iteration is not None:
                        on_iteration(metrics)
                    if _stopped(run, number, cfg, metrics):
                        return str(run.root)
        run.set_status("completed")
        return str(run.root)
    except BaseException as exc:
        stop = stop_behind(exc)
        if stop is None:
            run.set_status("failed")
            raise
        # SIGTERM (a Prefect worker sends it to cancel) or SIGINT: every completed stage is kept, and
        # `run --resume` continues from the stage in flight.
        signal_name = interrupts.signal_name(signal_of(stop))
        with interrupts.recording():  # a second signal must not cut this write short
            run.set_status("interrupted", interrupted_by=signal_name)
        log.warning("run %s interrupted by %s; resume it with --resume %s", run.run_id, signal_name, run.root)
        raise
    finally:
        forget(run.root)
