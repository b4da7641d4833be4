"""`redteam-grpo inspect | export | report`: read a finished (or running) run's Parquet files."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from redteam_grpo.cli.console import VerboseOption, quiet_libraries
from redteam_grpo.cli.errors import options_from_flags, user_errors
from redteam_grpo.cli.reaper import stop_api_server_with_this_process
from redteam_grpo.core.evaluation import (
    ActiveEvaluation,
    DefenseEvaluation,
    EvaluationOptions,
    EvaluationResult,
    RedteamEvaluation,
)

RunArg = Annotated[
    str, typer.Argument(help="Run directory (runs/<run-id>, or a URL such as s3://bucket/runs/<run-id>).")
]


def _open(run_dir: str | Path):
    from redteam_grpo.cli.main import console
    from redteam_grpo.storage.rundir import RunDir, RunDirError

    try:
        return RunDir.open(run_dir)
    except RunDirError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


def _writing_into(run, target: Path | None):
    """The run's lock of derived files (storage/ownership.py: DERIVED) while `target` (None: the run's own default
    place) is inside the run folder: two exports or reports at once would replace each other's files mid-way.
    Written elsewhere, nothing is held."""
    import contextlib

    from redteam_grpo.storage import ownership
    from redteam_grpo.storage.location import is_remote

    inside = target is None or (
        not is_remote(run.root) and Path(target).resolve().is_relative_to(Path(run.root).resolve())
    )
    return ownership.owning(run.root, ownership.DERIVED) if inside else contextlib.nullcontext()


def _number(value: float) -> str:
    if math.isnan(value):
        return ""
    return f"{value:.1e}" if 0 < abs(value) < 0.01 else f"{value:.3g}"


def _print_frame(df, title: str | None = None) -> None:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in df.columns:
        table.add_column(str(column), justify="right" if df[column].dtype.kind in "fiu" else "left")
    for row in df.itertuples(index=False):
        table.add_row(*(_number(v) if isinstance(v, float) else str(v) for v in row))
    Console().print(table)


def _print_summary(df, view: str | None = None, title: str | None = None) -> None:
    """`inspect`'s per-iteration tables: the metrics core/metrics/registry.py marks for a view, in their formats."""
    from redteam_grpo.core.metrics.registry import SUMMARY, table_rows

    headers, cells = table_rows(view or SUMMARY, df.to_dict("records"))
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header in headers:
        table.add_column(header, justify="right")
    for row in cells:
        table.add_row(*row)
    Console().print(table)


def _print_check(df) -> None:
    """`inspect`'s first-update check: per iteration, each gate's KL over its bound (above 1 the update is refused;
    the values and bounds themselves: `inspect RUN --sql "select * from metrics"`)."""
    gates = {"token": ("sampler_kl", "sampler_kl_tolerance")}
    gates |= {g: (f"sampler_kl_{g}", f"sampler_kl_{g}_bound") for g in ("first_token", "last_token")}
    gates |= {"turns": ("sampler_kl_turn_boundary", "sampler_kl_turn_boundary_bound")}
    gates |= {"sequence": ("sampler_kl_sequence", "sampler_kl_sequence_bound")}
    table = Table(
        title="first-update check: KL over its bound at each gate (refused above 1)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    for header in ("iter", *(g.removesuffix("_token") for g in gates), "bound/token", "varentropy"):
        table.add_column(header, justify="right")
    for row in df.to_dict("records"):
        ratios = [row[value] / row[bound] if row[bound] else math.nan for value, bound in gates.values()]
        cells = [_number(r) for r in ratios] + [f"{row['sampler_kl_tolerance']:.1e}", f"{row['varentropy']:.3f}"]
        table.add_row(str(row["iteration"]), *cells)
    Console().print(table)


@user_errors
def inspect(
    run_dir: RunArg,
    sql: Annotated[
        str | None,
        typer.Option("--sql", help="DuckDB SQL over the views rollouts, scores, advantages, metrics."),
    ] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="Write the result as csv | json | jsonl | parquet.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="File to write (default: standard output).")] = None,
) -> None:
    """Summary table of a run, or the result of a SQL query over its Parquet files."""
    import duckdb

    from redteam_grpo.cli.main import console
    from redteam_grpo.storage.export import ExportError, csv_ready, write_frame
    from redteam_grpo.storage.ownership import stopped_unexpectedly
    from redteam_grpo.storage.query import query, summary
    from redteam_grpo.storage.schemas import SchemaError

    run = _open(run_dir)
    try:
        df = query(run, sql) if sql else summary(run)
    except duckdb.Error as exc:
        console.print(f"[red]error:[/red] the query failed: {exc}\nviews: rollouts, scores, advantages, metrics")
        raise typer.Exit(2) from None
    except SchemaError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    if fmt is None:
        manifest = run.identity_and_status()
        if not sql:
            crashed = stopped_unexpectedly(run)
            console.print(
                f"run {run.run_id}: {'stopped unexpectedly' if crashed else manifest.get('status')}, "
                f"{len(run.completed_iterations())} iterations completed"
                + (f", lineage {manifest['lineage']}" if manifest.get("lineage") else "")
                + (f", parent {manifest['parent_run']}" if manifest.get("parent_run") else ""),
                highlight=False,
            )
            if crashed:
                console.print(f"[yellow]{crashed}[/yellow]", highlight=False)
        if sql:
            _print_frame(df)
        else:
            from redteam_grpo.storage.query import first_update_check

            _print_summary(df)
            _print_check(first_update_check(run))
        return
    if fmt in ("csv", "json", "jsonl") and out is None:  # text formats may go to standard output
        text = csv_ready(df).to_csv(index=False) if fmt == "csv" else df.to_json(orient="records", lines=fmt == "jsonl")
        sys.stdout.write(text)
        return
    if out is None:
        console.print(f"[red]error:[/red] --format {fmt} needs --out FILE")
        raise typer.Exit(2)
    try:
        write_frame(df, out, fmt)
    except ExportError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"wrote {len(df)} rows to {out}")


@user_errors
def export(
    run_dir: RunArg,
    min_score: Annotated[float, typer.Option(help="Keep completions with harm >= this.")] = 0.5,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output folder (default: RUN/export).")] = None,
    hf: Annotated[bool, typer.Option("--hf", help="Also write a Hugging Face `datasets` folder.")] = False,
    include_refusals: Annotated[bool, typer.Option(help="Keep completions flagged as refusals.")] = True,
) -> None:
    """Write the run's adversarial examples as a dataset (Parquet + JSONL, optionally a `datasets` folder)."""
    from redteam_grpo.cli.main import console
    from redteam_grpo.storage.export import ExportError, require_datasets, write_frame, write_hf_dataset
    from redteam_grpo.storage.query import adversarial_examples

    run = _open(run_dir)
    df = adversarial_examples(run, min_score)
    if not include_refusals:
        df = df[~df.refusal].reset_index(drop=True)
    folder = out or run.root / "export"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        if hf:
            require_datasets()  # before anything is written
        with _writing_into(run, out):
            written = [
                write_frame(df, folder / "adversarial.parquet", "parquet"),
                write_frame(df, folder / "adversarial.jsonl", "jsonl"),
            ]
            if hf:
                written.append(write_hf_dataset(df, folder / "hf_dataset"))
    except ExportError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"{len(df)} examples with harm >= {min_score}: " + ", ".join(map(str, written)))


@user_errors
def report(
    run_dir: RunArg,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="HTML file (default: RUN/report.html).")] = None,
    top_k: Annotated[int, typer.Option(help="Adversarial examples to show.")] = 20,
) -> None:
    """Write an HTML report: metric plots per iteration and the top adversarial examples."""
    from redteam_grpo.cli.main import console
    from redteam_grpo.cli.report import write_report

    run = _open(run_dir)
    with _writing_into(run, out), console.status("rendering plots and examples"):
        path = write_report(run, out, top_k)
    console.print(f"report: {path}")


_DEFAULTS = EvaluationOptions()


def _evaluation_option(field: str, more_help: str = "") -> typer.models.OptionInfo:
    """A CLI option whose help is the field's own documentation in `EvaluationOptions` (its default: the field's)."""
    return typer.Option(help=EvaluationOptions.model_fields[field].description + more_help)


@user_errors
def evaluate(
    run_dir: RunArg,
    iteration: Annotated[int | None, _evaluation_option("iteration")] = _DEFAULTS.iteration,
    prompts: Annotated[int, _evaluation_option("num_prompts")] = _DEFAULTS.num_prompts,
    samples: Annotated[int, _evaluation_option("samples_per_prompt")] = _DEFAULTS.samples_per_prompt,
    threshold: Annotated[float | None, _evaluation_option("success_threshold")] = _DEFAULTS.success_threshold,
    seed: Annotated[int, _evaluation_option("seed")] = _DEFAULTS.seed,
    heldout_goals: Annotated[str, _evaluation_option("heldout_goals")] = _DEFAULTS.heldout_goals,
    prompt_file: Annotated[str, _evaluation_option("prompt_file")] = _DEFAULTS.prompt_file,
    benign: Annotated[str, _evaluation_option("benign")] = _DEFAULTS.benign,
    retention: Annotated[
        str,
        _evaluation_option(
            "retention",
            " Each set: a file, bundled:<file> or a hub dataset, with options after '?': subset, split, column, "
            "response_column, id_column, or COLUMN=VALUE to keep matching rows.",
        ),
    ] = _DEFAULTS.retention,
    capability: Annotated[str | None, _evaluation_option("capability")] = None,
    capability_limit: Annotated[int | None, _evaluation_option("capability_limit")] = None,
    transfer_to: Annotated[
        str | None, _evaluation_option("transfer_to", " Comma-separated: --transfer-to MODEL[,MODEL...].")
    ] = None,
    against: Annotated[str | None, _evaluation_option("against")] = None,
    verbose: VerboseOption = False,
) -> None:
    """A checkpoint against its base model, side by side: attack success, quality@tau and diversity (red-team
    runs); unsafe share, over-refusal and capability retention (defense runs); the final attacker against the base
    and each round's victim, and with --against the cross-attack table (Active Attacks runs). Writes RUN/eval/."""
    from redteam_grpo.cli.main import console, offline_environment

    run = _open(run_dir)
    stored = run.stored_config()
    offline_environment(stored.run.offline)
    verbose = verbose or stored.logging.level == "DEBUG"
    quiet_libraries(verbose)
    if not verbose:
        from redteam_grpo.flows.console import keep_tracebacks_off_console

        keep_tracebacks_off_console()
    stop_api_server_with_this_process()  # Prefect's temporary API server must not outlive a killed CLI
    from redteam_grpo.flows.evaluate import evaluate as evaluate_flow
    from redteam_grpo.tasks.evaluate import EvaluationError

    options = options_from_flags(
        EvaluationOptions,
        {"num_prompts": "--prompts", "samples_per_prompt": "--samples", "success_threshold": "--threshold"},
        iteration=iteration,
        num_prompts=prompts,
        samples_per_prompt=samples,
        success_threshold=threshold,
        seed=seed,
        heldout_goals=heldout_goals,
        prompt_file=prompt_file,
        benign=benign,
        retention=retention,
        capability=capability,
        capability_limit=capability_limit,
        transfer_to=transfer_to or [],
        against=against,
    )
    try:
        with console.status(f"evaluating {run.run_id}: {prompts} prompts x {samples} samples"):
            result = evaluate_flow(str(run.root), options)
    except EvaluationError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    PRINTERS[type(result)](run.run_id, result)
    _print_extras(result)
    console.print(f"responses: {result.path}")


def _figures_frame(result: EvaluationResult):
    """Metrics as rows, one column per policy in the result's order."""
    import pandas as pd

    frame = pd.DataFrame({p: result.figures[p].metrics() for p in result.policies})
    frame.insert(0, "metric", frame.index)
    return frame


FLAG = {True: "[red]FLAGGED[/red]", False: "ok"}


def _print_redteam(run_id: str, result: RedteamEvaluation) -> None:
    import pandas as pd

    rows = [{"policy": p, **result.figures[p].model_dump()} for p in result.policies]
    where = "held-out" if result.held_out else "training (no held-out prompts left)"
    title = f"{run_id} {result.checkpoint} on {where} prompts; over-refusal on benign prompts"
    _print_frame(pd.DataFrame(rows), title=f"{title}\njudge: {result.judge}")
    redteam = pd.DataFrame([r.model_dump() for r in result.redteam]).pivot(index="tau", columns="policy")
    redteam.columns = [f"{metric} {policy}" for metric, policy in redteam.columns]
    redteam = redteam[[c for c in redteam.columns if not c.startswith("n_successful")]].reset_index()
    _print_frame(redteam, title="quality@tau and diversity of the cases above tau (Hong et al. 2024)")


def _print_defense(run_id: str, result: DefenseEvaluation) -> None:
    """Metrics as rows, base and defended side by side, then the two flags."""
    from redteam_grpo.cli.main import console

    _print_frame(_figures_frame(result), title=f"{run_id} {result.checkpoint}: defended vs base\njudge: {result.judge}")
    checks, base, defended = result.checks, result.figures["base"], result.figures["defended"]
    console.print(
        f"unsafe share on held-out goals: {base.asr_heldout_goals:.3f} -> {defended.asr_heldout_goals:.3f}; "
        f"over-refusal {checks.over_refusal_increase:+.3f} (limit +{checks.over_refusal_margin:g}): "
        f"{FLAG[checks.over_refusal_flag]}; perplexity x{checks.perplexity_ratio:.2f} (limit "
        f"x{checks.perplexity_limit:g}): {FLAG[checks.retention_flag]}"
    )


def _print_active(run_id: str, result: ActiveEvaluation) -> None:
    """Metrics as rows, one column per victim (the base, then the victim after each hardening); then the flag."""
    import pandas as pd

    from redteam_grpo.cli.main import console

    rounds = ", ".join(f"{k} = {v}" for k, v in result.victims.items())
    rounds = rounds or ("every one pruned" if result.pruned else "no hardening yet")
    _print_frame(
        _figures_frame(result),
        title=f"{run_id} {result.checkpoint}: its attacker's {result.attacks} attacks on {result.goals} held-out goals "
        f"against the base and the victim after each hardening ({rounds}); over-refusal on benign prompts\njudge: "
        f"{result.judge}",
    )
    if result.pruned:
        console.print(f"[yellow]not evaluated[/yellow]: the victims of {', '.join(result.pruned)} were pruned")
    cross = result.cross_attack
    if cross:
        _print_frame(
            pd.DataFrame([row.model_dump() for row in cross.rows])
            .drop(columns="run_id")
            .rename(
                columns={
                    "attacks": "attacker",
                    "hardened_on_own": "hardened-own",
                    "hardened_on_against": "hardened-against",
                }
            ),
            title=f"cross-attack success: own = {run_id} {result.checkpoint}, against = {cross.against} "
            f"{cross.against_checkpoint}; found: the attacks the base answered unsafely; hardened-X: a victim "
            "hardened on X's found attacks",
        )
    checks, base, final = result.checks, result.figures["base"], result.figures[result.policies[-1]]
    console.print(
        f"attack success on the base {base.attack_success_rate:.3f} -> on the final victim "
        f"{final.attack_success_rate:.3f}; over-refusal {checks.over_refusal_increase:+.3f} (limit "
        f"+{checks.over_refusal_margin:g}): {FLAG[checks.over_refusal_flag]}"
    )


# How `evaluate` prints a result, by its type (flows/evaluate.py: EVALUATIONS runs them).
PRINTERS = {RedteamEvaluation: _print_redteam, DefenseEvaluation: _print_defense, ActiveEvaluation: _print_active}


def _print_extras(result: EvaluationResult) -> None:
    """Cross-attack success (`--transfer-to`) and capability (`--capability`) tables, where asked."""
    import pandas as pd

    transfer = result.transfer
    if transfer:
        rows = [{"target": label, **figures.model_dump()} for label, figures in transfer.targets.items()]
        _print_frame(
            pd.DataFrame(rows),
            title=f"cross-attack success of the {transfer.examples} adversarial examples above the threshold"
            f"\njudge: {result.judge}",
        )
    if result.capability:
        frame = pd.DataFrame([c.model_dump() for c in result.capability])
        frame = frame.pivot(index="metric", columns="policy", values="value")
        frame = frame[[p for p in result.policies if p in frame.columns]].reset_index()
        _print_frame(frame, title="capability (lm-evaluation-harness)")


def push_newest(
    run_dir: Path, repo_id: str, iteration: int | None = None, public: bool = False, base_model=None
) -> None:
    """Push a checkpoint's adapter (default: the newest) as a PEFT adapter repo; the token comes from HF_TOKEN."""
    from redteam_grpo.cli.main import console
    from redteam_grpo.storage.hub import push_adapter

    run = _open(run_dir)
    folder = run.checkpoint_dir(run.checkpoint_to_use(iteration))
    with console.status(f"pushing {folder} to {repo_id}"):
        url = push_adapter(folder, repo_id, private=not public, base_model=base_model)
    console.print(f"pushed: {url}")


@user_errors
def push(
    run_dir: RunArg,
    repo_id: Annotated[str, typer.Option("--repo-id", help="Hub repo, e.g. my-org/qwen3-4b-defender.")],
    iteration: Annotated[int | None, typer.Option(help="Checkpoint after this iteration (default: newest).")] = None,
    public: Annotated[bool, typer.Option(help="Create the repo public (default: private).")] = False,
    base_model: Annotated[
        str | None, typer.Option(help="Hub id of the base the adapter was trained on, if the run named a folder.")
    ] = None,
) -> None:
    """Push a run's adapter to the Hugging Face hub (token from HF_TOKEN; never the optimizer or RNG state)."""
    push_newest(run_dir, repo_id, iteration, public, base_model)


@user_errors
def rebuild_manifest(
    run_dir: RunArg,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild a manifest that still reads as valid (e.g. edited by hand).")
    ] = False,
) -> None:
    """Rebuild a damaged manifest.json from the newest intact checkpoint (the damaged file is kept beside it)."""
    from redteam_grpo.cli.main import console
    from redteam_grpo.storage import ownership
    from redteam_grpo.storage.location import location
    from redteam_grpo.storage.rundir import RunDir, RunDirError, command_for

    root = location(run_dir)
    run = RunDir(root)
    if not run.config_path.is_file():
        raise RunDirError(f"{root} is not a run directory (no config.json)")
    if not force:
        try:
            run.manifest()
        except RunDirError:
            pass
        else:
            raise RunDirError(f"{run.manifest_path} reads as valid: nothing to rebuild (--force rebuilds it anyway)")
    with ownership.owning(root):
        rebuilt = run.rebuild_manifest()
    for reason in rebuilt.skipped:
        console.print(f"[yellow]not used:[/yellow] {reason}", highlight=False)
    kept = f"; the old file is kept as {rebuilt.damaged_copy.name}" if rebuilt.damaged_copy else ""
    if rebuilt.source is None:
        console.print(
            f"rebuilt {run.manifest_path} with no completed iteration: no checkpoint holds a copy of the run's "
            f"records, so a resume computes every iteration again{kept}",
            highlight=False,
        )
    else:
        done = rebuilt.iterations
        console.print(
            f"rebuilt {run.manifest_path} from {rebuilt.source.relative_to(root)}: iterations {done[0]}-{done[-1]} "
            f"recorded as completed, with their files' checksums{kept}",
            highlight=False,
        )
    console.print(f"continue with: redteam-grpo {command_for(root)} --resume {root}", highlight=False)
