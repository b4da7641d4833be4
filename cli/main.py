"""`redteam-grpo`: run, resume, inspect the config, and generate from a checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from redteam_grpo.cli.console import VerboseOption, quiet_libraries
from redteam_grpo.cli.errors import name_the_run, options_from_flags, user_errors
from redteam_grpo.cli.reaper import stop_api_server_with_this_process
from redteam_grpo.storage.location import location

app = typer.Typer(help="GRPO red-teaming of language models, as Prefect stages over Parquet.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect the configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console(stderr=True, soft_wrap=True)  # errors stay greppable: no hard wraps

ConfigOption = Annotated[Path | None, typer.Option("--config", "-c", help="YAML or JSON config file.")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override one field: section.key=value (repeatable).")
]


@app.callback()
def grant_options(
    trust_remote_code: Annotated[
        str | None,
        typer.Option(
            "--trust-remote-code",
            metavar="NAME@COMMIT",
            help="Let this one policy model run its own code (a hub repo's auto_map .py files), at this commit "
            "(set model.revision to it), or a local FOLDER. Read the code first. Never taken from a config or a "
            "run folder. Also REDTEAM_GRPO_TRUST_REMOTE_CODE.",
        ),
    ] = None,
) -> None:
    """GRPO red-teaming of language models, as Prefect stages over Parquet."""
    if trust_remote_code:
        # the environment carries the grant to this process's own workers (torchrun, Ray, a Prefect subprocess)
        os.environ["REDTEAM_GRPO_TRUST_REMOTE_CODE"] = trust_remote_code


def offline_environment(offline: bool) -> None:
    """No network outside loopback unless asked: hub look-ups and Prefect analytics off.

    Must run before prefect or transformers are imported (they read these at import time).
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A first ephemeral API creates its database; on a busy 2-core machine that takes ~20 s, Prefect's default limit.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"


def _load(config: Path | None, overrides: list[str] | None, stored=None, mode: str = "attack"):
    from redteam_grpo.core.config import ConfigError, Secrets, load_config

    secrets = Secrets()  # HF_TOKEN etc. from the environment or ./.env
    if secrets.hf_token is not None:
        os.environ.setdefault("HF_TOKEN", secrets.hf_token.get_secret_value())
    try:
        base = stored.model_dump(mode="json") if stored is not None else None
        return load_config(config, overrides or [], base, mode)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


ResumeOption = Annotated[str | None, typer.Option(help="Continue the run in this directory (a folder or a URL).")]
PushOption = Annotated[
    str | None,
    typer.Option(
        "--push-to-hub",
        help="After the run, push its newest adapter to this hub repo (private; token from HF_TOKEN; "
        "needs --set run.offline=false and a hub base model).",
    ),
]
RedoOption = Annotated[
    str | None,
    typer.Option(help="With --resume: recompute ITERATION or ITERATION/STAGE and all after it (e.g. 7/score)."),
]


def _training_command(mode: str, help_text: str):
    """The `run`, `sft`, `defense` and `active` commands: one signature, one body (`_train`), each mode's flow and
    defaults."""

    def command(
        config: ConfigOption = None,
        set_: SetOption = None,
        resume: ResumeOption = None,
        redo: RedoOption = None,
        push_to_hub: PushOption = None,
        verbose: VerboseOption = False,
    ) -> None:
        _train(mode, config, set_, resume, redo, verbose, push_to_hub)

    command.__doc__ = help_text
    return user_errors(command)


run = app.command("run")(
    _training_command("attack", "Run GRPO red-teaming (embedded tiny models by default), or resume a run.")
)
sft = app.command("sft")(
    _training_command(
        "sft",
        "Fine-tune an attacker on (goal -> adversarial prompt) pairs (the bundled pairs by default), or resume one.",
    )
)
defense = app.command("defense")(
    _training_command(
        "defense", "Train a defender against an attacker's prompts and a safety judge (--set defense.attacker=SFT_RUN)."
    )
)
active = app.command("active")(
    _training_command(
        "active",
        "Active Attacks: train an attacker against a victim hardened on its attacks every few iterations "
        "(--set active.attacker=SFT_RUN).",
    )
)


def _train(
    mode: str,
    config: Path | None,
    set_: list[str] | None,
    resume: str | None,
    redo: str | None,
    verbose: bool,
    push_to_hub: str | None = None,
):
    from redteam_grpo.storage import ownership
    from redteam_grpo.storage.rundir import RunDir

    stored = None
    if resume is not None:
        # Fail before a Prefect API is started for nothing (`user_errors` prints the one line).
        stored = RunDir.open(resume).stored_config()
        ownership.refuse_if_owned(location(resume))  # the flow takes the lock; this only answers sooner
        set_ = _without_a_stored_ray_cluster(stored, set_)
        _refuse_stored_servers_beyond_loopback(stored, set_)
    # A resumed run's --config/--set change its stored config, never the defaults.
    cfg = _load(config, set_, stored, mode) if (config or set_ or stored is None) else None
    if push_to_hub and (cfg or stored).run.offline:
        console.print("[red]error:[/red] --push-to-hub needs the network: add --set run.offline=false")
        raise typer.Exit(2)
    offline_environment((cfg or stored).run.offline)
    verbose = verbose or (cfg or stored).logging.level == "DEBUG"
    quiet_libraries(verbose)
    if not verbose:
        from redteam_grpo.flows.console import keep_tracebacks_off_console

        keep_tracebacks_off_console()
    stop_api_server_with_this_process()  # Prefect's temporary API server must not outlive a killed CLI
    from redteam_grpo.cli.signals import StopOnSignal
    from redteam_grpo.flows.runner import with_run_id

    if cfg is not None and resume is None:
        cfg = with_run_id(cfg)  # the folder is known before the run starts, to name it if the run is stopped
    stop = StopOnSignal(
        location(resume) if resume is not None else RunDir.root_for(cfg),
        lambda line: console.print(line, markup=False, highlight=False),
    )
    stop.install()
    try:
        run_dir, metrics_rows = _run_with_progress(cfg, resume, redo, stop, mode)
    except Exception as exc:
        name_the_run(exc, stop.root)  # a message's `--resume RUN_DIR` becomes this run's folder
        raise
    finally:
        stop.uninstall()
    if mode == "sft":
        _print_sft_epochs(metrics_rows)
    else:
        _print_metrics(metrics_rows)
    console.print(f"run directory: [bold]{run_dir}[/bold]")
    if push_to_hub:
        from redteam_grpo.cli.runs import push_newest

        push_newest(location(run_dir), push_to_hub)


def _without_a_stored_ray_cluster(stored, set_: list[str] | None) -> list[str] | None:
    """A resumed run goes back to a Ray cluster only when the command line names it again: Ray unpickles what a
    cluster sends back, and the address in a run folder may have been written by someone else. Where the stages run
    does not change their rows (runtime.shards does), so a local Ray instance computes the same."""
    address = stored.runtime.ray_address
    if address is None or _named_again(set_, "runtime.ray_address"):
        return set_
    console.print(
        f"the run was on the Ray cluster at {address}: it resumes on a local Ray instance unless you name the cluster "
        f"again (--set runtime.ray_address={address})",
        markup=False,
        highlight=False,
    )
    return [*(set_ or []), "runtime.ray_address=null"]


def _named_again(set_: list[str] | None, key: str) -> bool:
    """Whether a `--set` of this command line gives `key` (a resumed run's stored value is not enough)."""
    return any(s.split("=", 1)[0].strip() == key for s in set_ or [] if "=" in s)


def _refuse_stored_servers_beyond_loopback(stored, set_: list[str] | None) -> None:
    """A resumed run sends your reward and sampler tokens, and its prompts and completions, to the servers its stored
    config names; one beyond this machine is used only when the command line names it again (the run folder may have
    been written by someone else)."""
    from urllib.parse import urlsplit

    from redteam_grpo.core.hosts import is_loopback
    from redteam_grpo.storage.rundir import RunDirError

    vllm_url = stored.sampling.vllm_url
    for key, urls in {"reward.url": stored.reward.urls, "sampling.vllm_url": [vllm_url] if vllm_url else []}.items():
        remote = [u for u in urls if not is_loopback(urlsplit(u).hostname or "")]
        if remote and not _named_again(set_, key):
            raise RunDirError(
                f"the run's config.json names {key} {', '.join(remote)}, beyond this machine: resuming would send it "
                f"your token and the run's texts. If you trust it, name it again: --set {key}=... (or point the run "
                f"at your own server the same way)"
            )


def _run_with_progress(cfg, resume: str | None, redo: str | None, stop, mode: str) -> tuple[str, list[dict]]:
    """The run, under a progress bar; returns its folder and its metrics rows. Errors a person can act on are
    turned into one line by `user_errors`; a stop signal into the resume hint and the signal's exit status."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from redteam_grpo.flows.active import active_run
    from redteam_grpo.flows.attack import attack_run
    from redteam_grpo.flows.defense import defense_run
    from redteam_grpo.flows.runner import STOP_EXCEPTIONS, signal_of
    from redteam_grpo.flows.sft import sft_run
    from redteam_grpo.storage.modes import mode_named

    # the flow of each mode's record
    flow = {"attack": attack_run, "sft": sft_run, "defense": defense_run, "active": active_run}[mode]
    label, shown_metric = mode_named(mode).label, mode_named(mode).progress
    metrics_rows: list[dict] = []
    progress = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=cfg is not None and not cfg.logging.progress,
    )
    with progress:
        bar = progress.add_task("", total=cfg.run.iterations if cfg else None)

        def on_iteration(metrics: dict) -> None:
            metrics_rows.append(metrics)
            progress.update(bar, advance=1, description=f"{shown_metric} {metrics[shown_metric]:.3f}")

        try:
            run_dir = flow(
                config=cfg.model_dump(mode="json") if cfg else None,
                resume=str(resume) if resume else None,
                on_iteration=on_iteration,
                redo=redo,
            )
        except STOP_EXCEPTIONS as exc:
            progress.stop()
            raise typer.Exit(stop.report(signal_of(exc))) from None
    return run_dir, metrics_rows


def _print_sft_epochs(rows: list[dict]) -> None:
    if not rows:
        return
    table = Table(title="epochs", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header in ("epoch", "train loss", "eval loss", "steps", "s"):
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(
            str(r["iteration"]),
            f"{r['train_loss']:.4f}",
            f"{r['eval_loss']:.4f}",
            str(r["steps"]),
            f"{r['seconds']:.1f}",
        )
    Console().print(table)


def _print_metrics(rows: list[dict]) -> None:
    """The iteration table: the metrics core/metrics/registry.py marks for it, in its order and formats."""
    if not rows:
        return
    from redteam_grpo.core.metrics.registry import TABLE, table_rows

    headers, cells = table_rows(TABLE, rows)
    # No column rules or edge padding: 10 columns fit an 80-character terminal.
    table = Table(title="iterations", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header in headers:
        table.add_column(header, justify="right")
    for row in cells:
        table.add_row(*row)
    Console().print(table)


@config_app.command("show")
@user_errors
def config_show(
    config: ConfigOption = None,
    set_: SetOption = None,
    mode: Annotated[str, typer.Option(help="The defaults of this mode: attack, sft, defense or active.")] = "attack",
) -> None:
    """Print the full config (defaults, or with a file and overrides applied), every field documented."""
    from redteam_grpo.core.config import documented_defaults

    if config or set_ or mode != "attack":
        import yaml

        cfg = _load(config, set_, mode=mode)
        sys.stdout.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    else:
        sys.stdout.write(documented_defaults())


@app.command()
@user_errors
def infer(
    run: Annotated[str, typer.Option("--run", help="Run directory (a folder or a URL).")],
    prompt: Annotated[str, typer.Option(help="User prompt.")],
    checkpoint: Annotated[int | None, typer.Option(help="Iteration of the checkpoint (default: latest).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Completion length limit.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 for greedy decoding.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling (1: off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0: off).")] = 0,
    min_new_tokens: Annotated[int, typer.Option(help="Forbid end-of-turn for the first n tokens.")] = 0,
    repetition_penalty: Annotated[float, typer.Option(help="transformers' repetition penalty (1: off).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    verbose: VerboseOption = False,
) -> None:
    """Generate a response from a checkpoint of a run (sampling options that RL runs refuse are allowed here)."""
    from redteam_grpo.core.config import InferenceConfig

    options = options_from_flags(
        InferenceConfig,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_new_tokens=min_new_tokens,
        repetition_penalty=repetition_penalty,
        seed=seed,
    )
    offline_environment(True)
    quiet_libraries(verbose)
    from redteam_grpo.tasks.infer import InferenceError, generate_from_checkpoint

    try:
        text = generate_from_checkpoint(run, prompt, checkpoint, options)
    except InferenceError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    sys.stdout.write(text + "\n")


def _register_commands() -> None:
    from redteam_grpo.cli.runs import evaluate, export, inspect, push, rebuild_manifest, report
    from redteam_grpo.cli.serve import install_sampler, serve_reward, serve_sampler

    app.command("serve-reward")(serve_reward)
    app.command("serve-sampler")(serve_sampler)
    app.command("install-sampler")(install_sampler)
    app.command()(inspect)
    app.command()(export)
    app.command()(report)
    app.command()(evaluate)
    app.command()(push)
    app.command("rebuild-manifest")(rebuild_manifest)


_register_commands()

if __name__ == "__main__":
    app()
