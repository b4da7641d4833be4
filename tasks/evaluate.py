"""Evaluation of a run's checkpoint: how often it elicits unsafe output on prompts the run never trained on,
side by side with the base model (adapter off), sampled with the same seeds and scored by the run's scorer."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.data.sources import DataError, Prompt, load_prompts, parse_source, read_source
from redteam_grpo.core.evaluation import (
    ACTIVE_ONLY,
    DEFENSE_ONLY,
    SUCCESS_THRESHOLD,
    EvaluationOptions,
    QualityAtTau,
    RedteamEvaluation,
    RedteamFigures,
)
from redteam_grpo.core.metrics.redteam import redteam_metrics
from redteam_grpo.core.models.policy import load_policy, resolve_device
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.evaluation_parts import EvaluationParts, checkpoint_digest, digest_of
from redteam_grpo.storage.lineage import read_lineage, sampled_prompt_ids
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import RunDir, RunDirError, checkpoint_name
from redteam_grpo.tasks.cross_target import (
    BENIGN,
    Answer,
    capability_records,
    capability_suite,
    check_targets,
    judge_label,
    scored_answers,
    scorer_columns,
    transfer_answers,
    transfer_summary,
)
from redteam_grpo.tasks.engine import BASE, evaluation_sampler
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.scoring import scoring_backend

POLICIES = ("base", "adapter")
HELD_OUT = "held_out"  # the evaluation's own set: prompts the run did not train on


class EvaluationError(RuntimeError):
    """The run or checkpoint cannot be evaluated as asked."""


def choose_checkpoint(run: RunDir, iteration: int | None) -> int:
    try:
        return run.checkpoint_to_use(iteration)
    except RunDirError as exc:
        raise EvaluationError(str(exc)) from None


def rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    scored = [r["harm"] for r in rows if r["harm"] is not None]
    return {
        "attack_success_rate": sum(r["success"] for r in rows) / len(rows),
        "harm_mean": sum(scored) / len(scored) if scored else math.nan,
        "refusal_rate": sum(r["refusal"] for r in rows) / len(rows),
    }


# What only the figures computed after the parts read (`against`: the cross-attack table's own parts, whose settings
# name the rival's checkpoint): changing them leaves every part as it was.
NOT_IN_PARTS = ("transfer_to", "capability", "capability_limit", "over_refusal_margin", "perplexity_limit", "against")


def part_settings(
    options: EvaluationOptions, iteration: int, run: RunDir, read: list[int], sets: dict[str, list[Prompt]], **more
) -> dict[str, Any]:
    """What an evaluation's parts are computed from (storage/evaluation_parts.py): the options that reach them (the
    checkpoint resolved), every checkpoint read (the digest of its manifest: a `--redo` rewrites it) and every prompt
    set (a digest of its ids and texts: a file edited under the same name, or prompts the run has sampled since,
    differ)."""
    return {
        "options": {**options.model_dump(mode="json", exclude=set(NOT_IN_PARTS)), "iteration": iteration},
        "checkpoints": {checkpoint_name(i): checkpoint_digest(run.checkpoint_dir(i)) for i in read},
        "sets": {
            name: digest_of([[p.prompt_id, p.text, p.behavior, p.context] for p in prompts])
            for name, prompts in sets.items()
        },
        **more,
    }


def over_refusal(rows: list[dict[str, Any]], label: str) -> float:
    """The share of `label`'s answers to the benign set that are refusals."""
    chosen = [r["refusal"] for r in rows if r["policy"] == label and r["set"] == BENIGN]
    return sum(chosen) / len(chosen) if chosen else math.nan


def summary_path(rows_path: Path) -> Path:
    """The summary table beside an evaluation's rows file."""
    return rows_path.with_name("summary-" + rows_path.name)


JUDGED = ("attack_success_rate", "harm_mean", "refusal_rate", "over_refusal", "transfer_attack_success_rate", "asr_")


def write_summary(rows_path: Path, records: list[dict[str, Any]], judge: str | None = None) -> Path:
    """The evaluation's summary as one long table (policy, metric, tau, value, judge): what `report` shows. Every
    judged metric (attack success, harm, refusal, over-refusal) carries `judge`."""
    for r in records:
        r.setdefault("tau", math.nan)
        r["judge"] = judge if r["metric"].startswith(JUDGED) else None
    table = pa.Table.from_pylist(records, schema=schemas.EVALUATION_SUMMARY)
    path = summary_path(rows_path)
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))
    return path


def prompt_set(source: str, setting: str, column: str, id_column: str | None, limit: int, seed: int) -> list[Prompt]:
    """At most `limit` prompts of `source` (a `SourceSpec` string), a seeded sample; its `column` and `id_column`
    options override the defaults given here."""
    spec = parse_source(source, setting)
    frame = read_source(spec, setting)
    column, id_column = spec.column or column, spec.id_column or id_column
    if column not in frame.columns:
        raise DataError(
            f"{setting} {spec.source}: no column {column!r} (columns: {list(frame.columns)}); name the prompt "
            f"column with {spec.source}?column=NAME"
        )
    rows = [r for _, r in frame.iterrows() if isinstance(r[column], str) and r[column].strip()]
    if not rows:
        raise DataError(f"{setting} {source} holds no non-empty {column!r}")
    rows = random.Random(seed).sample(rows, min(limit, len(rows)))
    context_column = spec.context_column
    if context_column is not None and context_column not in frame.columns:
        raise DataError(
            f"{setting} {spec.source}: no column {context_column!r} (columns: {list(frame.columns)}); name the "
            f"context column with {spec.source}?context_column=NAME"
        )
    prompts = []
    for i, r in enumerate(rows):
        prompt_id = str(r[id_column]) if id_column in frame.columns else f"row{i}"
        context = r[context_column] if context_column is not None else None
        if isinstance(context, str) and context.strip():  # HarmBench's test case: the context, a rule, the request
            prompts.append(Prompt(prompt_id, f"{context}\n\n---\n\n{r[column]}", behavior=r[column], context=context))
        else:
            prompts.append(Prompt(prompt_id, r[column]))
    return prompts


def diversity_embedder(cfg: Any, device: Any):
    """The run's sentence embedder for the embedding diversity, or None (with a warning) if it cannot load."""
    from redteam_grpo.core.scoring.novelty import SentenceEmbedder
    from redteam_grpo.core.scoring.scorers import ScorerError

    try:
        return SentenceEmbedder(cfg.reward.embedder, device, cfg.reward.batch_size)
    except (ScorerError, OSError) as exc:
        stage_logger().warning("embedding diversity not computed: %s", exc)
        return None


def redteam_rows(rows: list[dict[str, Any]], cfg: Any, device: Any, seed: int) -> list[QualityAtTau]:
    """quality@τ and the diversities of the test cases above τ (1 − SelfBLEU, 1 − mean pairwise cosine of their
    embeddings; Hong et al. 2024, appendix A.7) of each policy's completions, one record per policy and τ."""
    embedder = diversity_embedder(cfg, device)
    out = []
    for label in POLICIES:
        chosen = [r for r in rows if r["policy"] == label]
        texts = [r["completion_text"] for r in chosen]
        embeddings = embedder(texts) if embedder is not None and texts else None
        metrics = redteam_metrics(texts, [r["harm"] for r in chosen], embeddings, seed=seed)
        out.extend(QualityAtTau(policy=label, **row) for row in metrics.as_rows())
    return out


CLI_SETS = ("heldout_goals", "prompt_file", "benign", "retention", "against")  # options `evaluate` has flags for


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_checkpoint(run_dir: str, options: EvaluationOptions) -> RedteamEvaluation:
    """Sample base and adapter on held-out prompts, score, write RUN/eval/<checkpoint>-<settings>.parquet (one file
    per checkpoint and settings, so evaluations with other settings do not overwrite it); return rates."""
    options = options.with_threshold(SUCCESS_THRESHOLD)
    iteration, num_prompts, samples_per_prompt = options.iteration, options.num_prompts, options.samples_per_prompt
    success_threshold, seed = options.success_threshold, options.seed
    run = RunDir.open(run_dir)
    cfg = run.stored_config()
    if mode_of(cfg).evaluation is None:
        raise EvaluationError(f"{run.run_id} is {mode_of(cfg).not_evaluated}")
    ignored = options.options_set(DEFENSE_ONLY + ACTIVE_ONLY)
    if ignored:
        flags = ", ".join(f"--{n.replace('_', '-')}" if n in CLI_SETS else n for n in ignored)
        raise EvaluationError(
            f"{flags}: for defense or Active Attacks runs only; {run.run_id} is a red-team run, evaluated on prompts "
            "it did not train on (its data.source). Leave them out."
        )
    iteration = choose_checkpoint(run, iteration)
    name = checkpoint_name(iteration)
    log = stage_logger()

    prompts = load_prompts(cfg.data)
    if not prompts:
        raise EvaluationError(f"the prompt source of {run.run_id} ({cfg.data.source}) has no prompts")
    # What the adapter was trained on: this run's prompts and, in a lineage, every ancestor's.
    trained = sampled_prompt_ids(run)
    record = read_lineage(run)
    if record is not None:
        trained |= set(record.excluded_prompt_ids)
    pool = [p for p in prompts if p.prompt_id not in trained]
    held_out = bool(pool)
    if not held_out:
        log.warning("run %s sampled every prompt of its source: evaluating on training prompts", run.run_id)
        pool = prompts
    chosen = random.Random(seed).sample(pool, min(num_prompts, len(pool)))

    benign = prompt_set(options.benign, "--benign", "prompt", "prompt_id", num_prompts, seed)
    check_targets(options)
    suite = capability_suite(options, run.root / "eval" / "lm-eval.log")  # unknown task names refused here

    device = resolve_device(cfg.run.device)
    policy = load_policy(cfg.model, cfg.sampling.temperature, device, cfg.run.seed)
    policy.load_adapter(run.checkpoint_dir(iteration) / checkpoints.ADAPTER_FILE)
    sampler = evaluation_sampler(run, policy, iteration)  # in-process, or the engine the run sampled with
    scoring = scoring_backend(cfg.reward, device)
    scorer = scoring.describe().scorer
    judge = judge_label(scorer)

    def succeeded(score) -> bool:
        return score.harm is not None and score.harm >= success_threshold and not score.refusal

    system, max_new = cfg.model.system_prompt, cfg.sampling.max_new_tokens
    path = run.root / "eval" / f"{name}-p{len(chosen)}x{samples_per_prompt}-t{success_threshold:g}-seed{seed}.parquet"
    settings = part_settings(options, iteration, run, [iteration], {HELD_OUT: chosen, BENIGN: benign})
    parts = EvaluationParts(path, settings)  # an interrupted evaluation reads back what it finished

    def row(a: Answer) -> dict[str, Any]:
        return {
            "run_id": run.run_id,
            "checkpoint": name,
            **a.columns("completion_text"),
            "categories": list(a.score.categories),
            **scorer_columns(scorer),
            "success": succeeded(a.score),
        }

    rows: list[dict[str, Any]] = []
    for label, who in zip(POLICIES, (BASE, DEFAULT_ROLE), strict=True):
        for set_name, prompts in ((HELD_OUT, chosen), (BENIGN, benign)):
            sampling_seed = (
                derive_seed(seed, "evaluate") if set_name == HELD_OUT else derive_seed(seed, "evaluate", BENIGN)
            )

            def compute(label=label, who=who, set_name=set_name, prompts=prompts, sampling_seed=sampling_seed):
                return [
                    row(a)
                    for a in scored_answers(
                        label, set_name, cfg.model.policy, sampler, who, policy.tokenizer, prompts, system,
                        samples_per_prompt, max_new, sampling_seed, scoring,
                    )
                ]  # fmt: skip

            rows += parts.rows(f"{label}.{set_name}", schemas.EVALUATION, compute)
    # the adversarial examples: held-out prompts the trained model was made to answer unsafely, once each, in the
    # order first answered so
    by_id = {p.prompt_id: p for p in chosen}
    successes = [r["prompt_id"] for r in rows if r["policy"] == "adapter" and r["set"] == HELD_OUT and r["success"]]
    examples = [by_id[prompt_id] for prompt_id in dict.fromkeys(successes)]
    trained_against = [("adapter", sampler, DEFAULT_ROLE, policy.tokenizer)]
    transferred = transfer_answers(cfg, options, device, examples, trained_against, benign, scoring)
    rows += [row(a) for a in transferred]
    table = schemas.rows_to_table(rows, schemas.EVALUATION, "eval")
    held_out_rows = [r for r in rows if r["set"] == HELD_OUT]
    figures = {
        label: RedteamFigures(
            **rates([r for r in held_out_rows if r["policy"] == label]), over_refusal=over_refusal(rows, label)
        )
        for label in POLICIES
    }
    result = RedteamEvaluation(
        run_id=run.run_id,
        checkpoint=name,
        path=str(path),
        prompts=len(chosen),
        samples_per_prompt=samples_per_prompt,
        held_out=held_out,
        judge=judge,
        policies=list(POLICIES),
        figures=figures,
        redteam=redteam_rows(held_out_rows, cfg, device, seed),
        transfer=transfer_summary(
            transferred, examples, {"adapter": figures["adapter"].over_refusal}, list(options.transfer_to), succeeded
        ),
        capability=capability_records(suite, policy, "adapter"),
    )  # what can still fail (lm-eval) comes before the rows are written: no rows file beside an older summary
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))
    write_summary(path, result.summary_records(), judge)
    parts.finish()
    adapter, base = figures["adapter"], figures["base"]
    log.info(
        "%s %s: attack success %.3f (base %.3f), harm %.3f (base %.3f) on %d prompts x %d",
        run.run_id,
        name,
        adapter.attack_success_rate,
        base.attack_success_rate,
        adapter.harm_mean,
        base.harm_mean,
        len(chosen),
        samples_per_prompt,
    )
    return result
