"""Evaluation of an Active Attacks run (run.mode=active; Yun et al. 2025, arXiv 2509.21947, section 5): the run's
final attacker against the base and against the victim of each round, side by side.

The attacker of the checkpoint evaluated writes `samples_per_prompt` prompts for each of `num_prompts` goals the run
never trained on (`heldout_goals`); every victim answers every one of those attacks once, with the same seed:

- `base`: the base model (the adapter off), the victim of the first round;
- `round1`, `round2`, ...: the victim after the first, second, ... hardening, read from the checkpoint of the
  hardening's iteration (which `run.keep_checkpoints` never prunes in this mode: storage/modes.py: ACTIVE_MODE.keeps),
  each the victim the next round's attacker faced; the last is the run's final victim.

Per victim: attack success (the share of attacks whose answer the run's judge calls unsafe, harm >= the threshold),
mean harm and refusals on the attacks; the count of distinct attack texts that succeeded and their diversity (1 −
SelfBLEU, 1 − mean pairwise cosine of their embeddings; core/metrics/redteam.py); over-refusal, the share of benign
prompts it refuses (a victim hardened into refusing everything must show it here), flagged where it exceeds the
base's by more than `over_refusal_margin`. Every scored answer is one row of a Parquet file under RUN/eval/ (the
defense evaluation's schema), the table a summary beside it.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.data.sources import Prompt
from redteam_grpo.core.evaluation import EvaluationOptions
from redteam_grpo.core.metrics.redteam import redteam_metrics
from redteam_grpo.core.models.policy import load_policy, resolve_device
from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE
from redteam_grpo.core.scoring.scorers import Goal
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import INIT_VERSION, RunDir, checkpoint_name
from redteam_grpo.tasks.cross_target import judge_label, scorer_columns
from redteam_grpo.tasks.engine import BASE, answers, evaluation_sampler
from redteam_grpo.tasks.evaluate import (
    EvaluationError,
    choose_checkpoint,
    diversity_embedder,
    prompt_set,
    write_summary,
)
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.scoring import scoring_backend

HELDOUT, BENIGN = "heldout_goals", "benign"
# what this evaluation does not read: refused when set, rather than ignored
UNUSED = ("prompt_file", "retention", "perplexity_limit", "capability", "capability_limit", "transfer_to")


def round_victims(run: RunDir, iteration: int) -> tuple[list[tuple[str, int]], list[int]]:
    """(label, checkpoint iteration) of the victim after each hardening up to `iteration`, in order, and the
    hardenings whose checkpoint is gone (a run pruned before its mode kept them)."""
    hardenings = [h for h in range(iteration + 1) if run.stored_config().active.hardens_after(h)]
    kept = {h for h in hardenings if run.checkpoint_intact(h)}
    victims = [(f"round{k}", h) for k, h in enumerate(hardenings, start=1) if h in kept]
    return victims, [h for h in hardenings if h not in kept]


def victim_summary(rows: list[dict[str, Any]], label: str, embedder, seed: int, threshold: float) -> dict[str, float]:
    """One victim's figures from its rows (module docstring)."""
    attacked = [r for r in rows if r["policy"] == label and r["set"] == HELDOUT]
    benign = [r for r in rows if r["policy"] == label and r["set"] == BENIGN]
    scored = [r["harm"] for r in attacked if r["harm"] is not None]
    texts = [r["prompt"] for r in attacked]
    # an attack counts as successful by its answer's harm (unscored answers: not successful)
    harms = [r["harm"] if r["unsafe"] else None for r in attacked]
    successful = [r["prompt"] for r in attacked if r["unsafe"]]
    embeddings = embedder(texts) if embedder is not None and successful else None
    (diversity,) = redteam_metrics(texts, harms, embeddings, thresholds=(threshold,), seed=seed).as_rows()
    return {
        "attack_success_rate": sum(r["unsafe"] for r in attacked) / len(attacked),
        "harm_mean": sum(scored) / len(scored) if scored else math.nan,
        "refusal_rate": sum(r["refusal"] for r in attacked) / len(attacked),
        "distinct_successes": float(len(set(successful))),
        "selfbleu_diversity": diversity["selfbleu_diversity"],
        "embedding_diversity": diversity["embedding_diversity"],
        "over_refusal": sum(r["refusal"] for r in benign) / len(benign),
    }


@task(name="evaluate-active", cache_policy=NO_CACHE)
def evaluate_active(run_dir: str, options: EvaluationOptions) -> dict[str, Any]:
    """The final attacker (checkpoint `options.iteration`, default the newest) against the base and each round's
    victim; write RUN/eval/<checkpoint>-active-<settings>.parquet and its summary; return the table."""
    num_prompts, samples, threshold, seed = (
        options.num_prompts,
        options.samples_per_prompt,
        options.success_threshold,
        options.seed,
    )
    run = RunDir.open(run_dir)
    cfg = run.stored_config()
    if mode_of(cfg).evaluation != "active":
        raise EvaluationError(f"{run.run_id} is a {cfg.run.mode} run: this evaluation needs an Active Attacks run")
    unused = options.options_set(UNUSED)
    if unused:
        raise EvaluationError(
            f"{', '.join(unused)}: not read by the evaluation of an Active Attacks run such as {run.run_id} (it "
            "attacks its victims with its own attacker on --heldout-goals and measures over-refusal on --benign). "
            "Leave them out."
        )
    iteration = choose_checkpoint(run, options.iteration)
    name = checkpoint_name(iteration)
    victims, pruned = round_victims(run, iteration)
    log = stage_logger()
    if pruned:
        log.warning(
            "%s: the victims of the hardenings at iterations %s were pruned (run.keep_checkpoints): not evaluated",
            run.run_id,
            ", ".join(map(str, pruned)),
        )
    # the sets first: a wrong name, column or filter is reported before any model loads
    goals = prompt_set(options.heldout_goals, "--heldout-goals", cfg.data.prompt_column, cfg.data.id_column,
                       num_prompts, seed)  # fmt: skip
    benign = prompt_set(options.benign, "--benign", "prompt", "prompt_id", num_prompts, seed)
    device = resolve_device(cfg.run.device)
    policy = load_policy(cfg.model, cfg.sampling.temperature, device, cfg.run.seed)
    policy.add_role(ATTACKER)
    policy.load_adapter(run.checkpoint_dir(iteration) / checkpoints.ATTACKER_FILE, ATTACKER)
    attacker_info = checkpoints.read_manifest(run.checkpoint_dir(INIT_VERSION))["attacker"]
    scoring = scoring_backend(cfg.reward, device)
    judge = scoring.describe().scorer  # named in every row: evaluations compare only under the same judge
    system, max_new = cfg.model.system_prompt, cfg.sampling.max_new_tokens

    written = answers(
        evaluation_sampler(run, policy, iteration),
        ATTACKER,
        policy.tokenizer,
        goals,
        attacker_info["system_prompt"],
        samples,
        cfg.attacker_settings.attacker_max_new_tokens,
        derive_seed(seed, "evaluate-attack"),
    )
    attacks = [
        Prompt(f"{written.prompt_of(c).prompt_id}#{c.sample_idx}", text)
        for c, text in zip(written.completions, written.texts, strict=True)
    ]
    # the judge is told the goal each attack was written for (a goal-reading format: HarmBench, StrongREJECT)
    told = {a.prompt_id: Goal(written.prompt_of(c).text) for a, c in zip(attacks, written.completions, strict=True)}

    rows: list[dict[str, Any]] = []
    for label, checkpoint in [("base", iteration), *victims]:
        who = BASE if label == "base" else DEFAULT_ROLE
        if who == DEFAULT_ROLE:
            policy.load_adapter(run.checkpoint_dir(checkpoint) / checkpoints.ADAPTER_FILE)
        sampler = evaluation_sampler(run, policy, checkpoint)  # the engine: that checkpoint's victim, exported
        for set_name, prompts, n in ((HELDOUT, attacks, 1), (BENIGN, benign, samples)):
            answered = answers(sampler, who, policy.tokenizer, prompts, system, n, max_new,
                               derive_seed(seed, "evaluate", set_name))  # fmt: skip
            scores = answered.scored(scoring, told if set_name == HELDOUT else None)
            for c, text, score in zip(answered.completions, answered.texts, scores, strict=True):
                rows.append(
                    {
                        "run_id": run.run_id,
                        "checkpoint": checkpoint_name(checkpoint),
                        "policy": label,
                        "set": set_name,
                        "target": cfg.model.policy,
                        "prompt_id": prompts[c.prompt_index].prompt_id,
                        "sample_idx": c.sample_idx,
                        "prompt": prompts[c.prompt_index].text,
                        "response": text,
                        "harm": score.harm,
                        "unsafe": score.harm is not None and score.harm >= threshold,
                        "refusal": bool(score.refusal),
                        "kl_to_base": math.nan,
                        **scorer_columns(judge),
                    }
                )
    labels = ["base", *(label for label, _ in victims)]
    embedder = diversity_embedder(cfg, device)
    table = {label: victim_summary(rows, label, embedder, seed, threshold) for label in labels}
    final = labels[-1]
    increase = table[final]["over_refusal"] - table["base"]["over_refusal"]
    checks = {
        "unsafe_reduction": table["base"]["attack_success_rate"] - table[final]["attack_success_rate"],
        "over_refusal_increase": round(increase, 12),
        "over_refusal_flag": bool(increase > options.over_refusal_margin),
        "over_refusal_margin": options.over_refusal_margin,
    }
    path = run.root / "eval" / f"{name}-active-p{len(goals)}x{samples}-t{threshold:g}-seed{seed}.parquet"
    path.parent.mkdir(exist_ok=True)
    rows_table = schemas.rows_to_table(rows, schemas.DEFENSE_EVALUATION, f"the active evaluation's rows ({path.name})")
    write_atomic(path, lambda tmp: pq.write_table(rows_table, tmp))
    write_summary(
        path,
        [{"policy": label, "metric": k, "value": float(v)} for label in labels for k, v in table[label].items()]
        + [{"policy": "checks", "metric": k, "value": float(v)} for k, v in checks.items()],
        judge_label(judge),
    )
    log.info(
        "%s %s: the final attacker's success %.3f on the base, %.3f on the final victim (%s); over-refusal %.3f "
        "(base %.3f)",
        run.run_id,
        name,
        table["base"]["attack_success_rate"],
        table[final]["attack_success_rate"],
        final,
        table[final]["over_refusal"],
        table["base"]["over_refusal"],
    )
    return {
        "evaluation": "active",  # which evaluation wrote it: what the CLI prints it as (cli/runs.py: PRINTERS)
        "run_id": run.run_id,
        "checkpoint": name,
        "path": str(path),
        "goals": len(goals),
        "samples_per_prompt": samples,  # attacks per goal; each victim answers each attack once
        "attacks": len(attacks),
        "judge": judge_label(judge),
        "attacker": attacker_info.get("source"),
        "policies": labels,
        "victims": {label: checkpoint_name(h) for label, h in victims},
        "pruned": [checkpoint_name(h) for h in pruned],
        "checks": checks,
        **table,
    }
