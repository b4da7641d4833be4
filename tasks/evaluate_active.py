"""Evaluation of an Active Attacks run (run.mode=active; Yun et al. 2025, arXiv 2509.21947, section 5): the run's
final attacker against the base and against the victim of each round, side by side.

The attacker of the checkpoint evaluated writes `samples_per_prompt` prompts for each of `num_prompts` goals the run
never trained on (`heldout_goals`); every victim answers every one of those attacks once, with the same seed:

- `base`: the base model (the adapter off), the victim of the first round (in a lineage, where the victim starts
  from the parent run's adapter, that victim is `round0`, beside the base);
- `round1`, `round2`, ...: the victim after the first, second, ... hardening, read from the checkpoint of the
  hardening's iteration (which `run.keep_checkpoints` never prunes in this mode: storage/modes.py: ACTIVE_MODE.keeps),
  each the victim the next round's attacker faced; the last is the run's final victim.

Per victim: attack success (the share of attacks whose answer the run's judge calls unsafe, harm >= the threshold:
`success_threshold`, by default the run's active.harm_threshold, what it counts as a found attack),
mean harm and refusals on the attacks; the count of distinct attack texts that succeeded and their diversity (1 −
SelfBLEU, 1 − mean pairwise cosine of their embeddings; core/metrics/redteam.py); over-refusal, the share of benign
prompts it refuses (a victim hardened into refusing everything must show it here), flagged where it exceeds the
base's by more than `over_refusal_margin`. Every scored answer is one row of a Parquet file under RUN/eval/ (the
defense evaluation's schema), the table a summary beside it.

With `against` (another run with an attacker on the same base: a self-play defense run, or another Active Attacks
run), the cross-attack table (the paper's Table 2): the other run's final attacker writes its prompts for the same
goals with the same seed; each attacker's *found* attacks are those the base answered unsafely (harm at or above the
evaluation's threshold, the same for both attackers); a victim is hardened from the base on each attacker's found
attacks with the run's own hardening recipe (tasks/harden.py: harden_victim); and each attacker's attacks meet the
base and both hardened victims. An attacker whose attacks also break the victim hardened on the other's found what
the other did not.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE
from safetensors.torch import load as load_safetensors

from redteam_grpo.core.data.sources import Prompt
from redteam_grpo.core.evaluation import (
    ActiveEvaluation,
    CrossAttack,
    CrossAttackRow,
    EvaluationOptions,
    OverRefusalCheck,
    VictimFigures,
    over_refusal_verdict,
)
from redteam_grpo.core.metrics.redteam import redteam_metrics
from redteam_grpo.core.models.policy import load_policy, resolve_device
from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE
from redteam_grpo.core.scoring.scorers import Goal
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.storage import checkpoints, schemas
from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.evaluation_parts import EvaluationParts, checkpoint_digest, digest_of
from redteam_grpo.storage.location import same_place
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import INIT_VERSION, RunDir, RunDirError, checkpoint_name
from redteam_grpo.tasks.cross_target import judge_label
from redteam_grpo.tasks.engine import BASE, answers, evaluation_sampler
from redteam_grpo.tasks.evaluate import (
    EvaluationError,
    choose_checkpoint,
    diversity_embedder,
    over_refusal,
    part_settings,
    prompt_set,
    write_summary,
)
from redteam_grpo.tasks.evaluate_defense import AttackSet, response_row, write_attacks
from redteam_grpo.tasks.harden import harden_victim, load_refusals
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.scoring import scoring_backend

HELDOUT, BENIGN = "heldout_goals", "benign"
# what this evaluation does not read: refused when set, rather than ignored
UNUSED = ("prompt_file", "retention", "perplexity_limit", "capability", "capability_limit", "transfer_to")


def round_victims(run: RunDir, iteration: int) -> tuple[list[tuple[str, int]], list[int]]:
    """(label, checkpoint iteration) of the victim after each hardening up to `iteration`, in order, and the
    hardenings whose checkpoint is gone (a run pruned before its mode kept them)."""
    schedule = run.stored_config().active
    hardenings = [h for h in range(iteration + 1) if schedule.hardens_after(h)]
    kept = {h for h in hardenings if run.checkpoint_intact(h)}
    victims = [(f"round{k}", h) for k, h in enumerate(hardenings, start=1) if h in kept]
    return victims, [h for h in hardenings if h not in kept]


def victim_figures(rows: list[dict[str, Any]], label: str, embedder, seed: int, threshold: float) -> VictimFigures:
    """One victim's figures from its rows (module docstring)."""
    attacked = [r for r in rows if r["policy"] == label and r["set"] == HELDOUT]
    scored = [r["harm"] for r in attacked if r["harm"] is not None]
    texts = [r["prompt"] for r in attacked]
    # an attack counts as successful by its answer's harm (unscored answers: not successful)
    harms = [r["harm"] if r["unsafe"] else None for r in attacked]
    successful = [r["prompt"] for r in attacked if r["unsafe"]]
    embeddings = embedder(texts) if embedder is not None and successful else None
    (diversity,) = redteam_metrics(texts, harms, embeddings, thresholds=(threshold,), seed=seed).as_rows()
    return VictimFigures(
        attack_success_rate=_share(attacked),
        harm_mean=sum(scored) / len(scored) if scored else math.nan,
        refusal_rate=sum(r["refusal"] for r in attacked) / len(attacked),
        distinct_successes=len(set(successful)),
        selfbleu_diversity=diversity["selfbleu_diversity"],
        embedding_diversity=diversity["embedding_diversity"],
        over_refusal=over_refusal(rows, label),
    )


@dataclass(frozen=True)
class Rival:
    """The run an evaluation is set against: its attacker's weights (read when the evaluation starts, so that a rival
    still training cannot prune them meanwhile), where they came from, and how it writes."""

    run_id: str
    checkpoint: str  # the rival's checkpoint whose attacker is used
    state: dict[str, Any]  # the attacker adapter's tensors
    digest: str  # that checkpoint's identity: a resumed table against another one starts over
    system_prompt: str | None
    max_new_tokens: int


def other_attacker(run: RunDir, against: str) -> Rival:
    """The run an evaluation is set against, checked to hold an attacker on this run's base: the newest
    checkpoint's attacker where it learns (self-play, Active Attacks), else the initial one (defense without
    self-play: its attacker is frozen, and only the initial checkpoint holds it)."""
    try:
        other = RunDir.open(against)
    except RunDirError as exc:
        raise EvaluationError(f"--against {against}: {exc}") from None
    cfg, other_cfg = run.stored_config(), other.stored_config()
    if same_place(other.root, run.root):
        raise EvaluationError(f"--against {against}: that is the run evaluated; give another run's folder")
    mode = mode_of(other_cfg)
    if ATTACKER not in mode.roles:
        raise EvaluationError(
            f"--against {against}: an {other_cfg.run.mode}-mode run has no attacker; give a self-play defense run "
            "(redteam-grpo defense --set defense.self_play=true) or another Active Attacks run"
        )
    if other_cfg.model.policy != cfg.model.policy:
        raise EvaluationError(
            f"--against {against}: its attacker writes for {other_cfg.model.policy}, this run's for "
            f"{cfg.model.policy}; the cross-attack table needs both attackers on the same base"
        )
    try:
        iteration = other.checkpoint_to_use(None)
        if ATTACKER not in mode.learning_roles(other_cfg):
            iteration = other.checkpoint_to_use(INIT_VERSION)
        folder = other.checkpoint_dir(iteration)
        state = load_safetensors((folder / checkpoints.ATTACKER_FILE).read_bytes())
        info = checkpoints.read_manifest(other.checkpoint_dir(INIT_VERSION))["attacker"]
    except (RunDirError, checkpoints.CheckpointError, OSError) as exc:
        raise EvaluationError(f"--against {against}: its attacker cannot be read: {exc}") from None
    return Rival(
        other.run_id,
        checkpoint_name(iteration),
        state,
        checkpoint_digest(folder),
        info["system_prompt"],
        other_cfg.attacker_settings.attacker_max_new_tokens,
    )


def attack_set_name(attack_set: AttackSet) -> str:
    """The rows' `set` of one attacker's attacks in the cross-attack table."""
    return f"attacks_{attack_set.label}"


def found_in(base_rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(id, text) of the attacks the base answered unsafely, each text once."""
    found: dict[str, str] = {}
    for r in base_rows:
        if r["unsafe"] and r["prompt"].strip():
            found.setdefault(r["prompt"], r["prompt_id"])
    return [(attack_id, text) for text, attack_id in found.items()]


def cross_attack(run, cfg, iteration, rival: Rival, policy, own: AttackSet, own_on_base, goals, samples, seed,
                 answer, parts: EvaluationParts):  # fmt: skip
    """The cross-attack table's rows (module docstring): per attacker, its attacks, those found (the base answered
    them unsafely), and the attack success against the base and against the victims hardened on each one's found
    attacks. `answer` samples, scores and records rows (a part each of `parts`); `own_on_base`: the base's rows for
    the run's own attacks. What was read back from parts is neither sampled nor hardened again."""
    policy.load_adapter_state(rival.state, ATTACKER)
    sampler = functools.cache(lambda: evaluation_sampler(run, policy, iteration, "-against"))
    theirs = write_attacks(sampler, policy, goals, rival.system_prompt, rival.max_new_tokens, samples, seed, "against",
                           parts)  # fmt: skip
    on_base = {
        "own": own_on_base,  # the base's answers to them, drawn with the same seed as the table's own
        "against": answer(
            sampler, BASE, "base", iteration, attack_set_name(theirs), theirs.attacks, 1, theirs.goals, parts
        ),
    }
    found = {label: found_in(base_rows) for label, base_rows in on_base.items()}
    success = {(label, "base"): _share(base_rows) for label, base_rows in on_base.items()}
    for hardened_on in (own, theirs):
        victim = f"hardened_on_{hardened_on.label}"

        @functools.cache
        def hardened(hardened_on: AttackSet = hardened_on, victim: str = victim):
            """The victim before any hardening (the initial checkpoint's adapter: the base), tuned on one side's
            found attacks; its sampler."""
            policy.load_adapter(run.checkpoint_dir(INIT_VERSION) / checkpoints.ADAPTER_FILE)
            if found[hardened_on.label]:
                with policy.role(DEFAULT_ROLE):
                    harden_victim(policy, found[hardened_on.label], cfg, (seed, "evaluate-harden", hardened_on.label))
            return evaluation_sampler(run, policy, iteration, f"-{victim}")

        for attack_set in (own, theirs):
            got = answer(hardened, DEFAULT_ROLE, victim, iteration, attack_set_name(attack_set), attack_set.attacks, 1,
                         attack_set.goals, parts)  # fmt: skip
            success[(attack_set.label, victim)] = _share(got)
    return CrossAttack(
        against=rival.run_id,
        against_checkpoint=rival.checkpoint,
        rows=[
            CrossAttackRow(
                attacks=attack_set.label,
                run_id=run.run_id if attack_set is own else rival.run_id,
                n=len(attack_set.attacks),
                found=len(found[attack_set.label]),
                **{victim: success[(attack_set.label, victim)] for victim in CrossAttackRow.VICTIMS},
            )
            for attack_set in (own, theirs)
        ],
    )


def _share(rows: list[dict[str, Any]]) -> float:
    return sum(r["unsafe"] for r in rows) / len(rows) if rows else math.nan


@task(name="evaluate-active", cache_policy=NO_CACHE)
def evaluate_active(run_dir: str, options: EvaluationOptions) -> ActiveEvaluation:
    """The final attacker (checkpoint `options.iteration`, default the newest) against the base and each round's
    victim; write RUN/eval/<checkpoint>-active-<settings>.parquet and its summary; return the table."""
    run = RunDir.open(run_dir)
    cfg = run.stored_config()
    if mode_of(cfg).evaluation != "active":
        raise EvaluationError(f"{run.run_id} is a {cfg.run.mode} run: this evaluation needs an Active Attacks run")
    options = options.with_threshold(cfg.active.harm_threshold)  # success: what the run counts as a found attack
    num_prompts, samples, threshold, seed = (
        options.num_prompts,
        options.samples_per_prompt,
        options.success_threshold,
        options.seed,
    )
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
    rival = other_attacker(run, options.against) if options.against is not None else None
    device = resolve_device(cfg.run.device)
    policy = load_policy(cfg.model, cfg.sampling.temperature, device, cfg.run.seed)
    policy.add_role(ATTACKER)
    policy.load_adapter(run.checkpoint_dir(iteration) / checkpoints.ATTACKER_FILE, ATTACKER)
    policy.load_adapter(run.checkpoint_dir(INIT_VERSION) / checkpoints.ADAPTER_FILE)
    with policy.role(DEFAULT_ROLE):
        if not policy.adapter_is_zero():  # a lineage's victim starts from its parent's adapter, not from the base
            victims = [("round0", INIT_VERSION), *victims]
    attacker_info = checkpoints.read_manifest(run.checkpoint_dir(INIT_VERSION))["attacker"]
    scoring = scoring_backend(cfg.reward, device)
    judge = scoring.describe().scorer  # named in every row: evaluations compare only under the same judge
    system, max_new = cfg.model.system_prompt, cfg.sampling.max_new_tokens

    stem = f"{name}-active-p{len(goals)}x{samples}-t{threshold:g}-seed{seed}"
    versus = "" if rival is None else f"-vs-{rival.run_id}"  # run ids are safe names (core/names.py)
    path = run.root / "eval" / f"{stem}{versus}.parquet"
    read = [iteration, INIT_VERSION, *(h for _, h in victims)]
    settings = part_settings(options, iteration, run, read, {HELDOUT: goals, BENIGN: benign})
    # the run's own parts, whatever it is set against; the cross-attack table's, against that rival's attacker
    parts = EvaluationParts(run.root / "eval" / f"{stem}.parquet", settings)
    if parts.discarded:
        log.info("%s: an earlier evaluation's parts under other settings were discarded", run.run_id)
    own = write_attacks(
        functools.cache(lambda: evaluation_sampler(run, policy, iteration)),
        policy,
        goals,
        attacker_info["system_prompt"],
        cfg.attacker_settings.attacker_max_new_tokens,
        samples,
        seed,
        "own",
        parts,
    )
    attacks, told = own.attacks, own.goals

    rows: list[dict[str, Any]] = []

    def answer(sampler: Callable[[], Any], who: str, label: str, checkpoint: int, set_name: str,
               prompts: list[Prompt], n: int, goals_told: dict[str, Goal] | None,
               store: EvaluationParts | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """`who`'s answers to `prompts`, scored, as rows (appended to the file's), with the set's seed: one part of
        `store` (the run's own parts by default), read back where an interrupted evaluation finished it (`sampler()`
        is then never called)."""

        def compute() -> list[dict[str, Any]]:
            return answer_rows(sampler(), who, label, checkpoint, set_name, prompts, n, goals_told)

        new = (store or parts).rows(f"{label}.{set_name}", schemas.DEFENSE_EVALUATION, compute)
        rows.extend(new)
        return new

    def answer_rows(sampler, who, label, checkpoint, set_name, prompts, n, goals_told) -> list[dict[str, Any]]:
        answered = answers(sampler, who, policy.tokenizer, prompts, system, n, max_new,
                           derive_seed(seed, "evaluate", HELDOUT if set_name != BENIGN else BENIGN))  # fmt: skip
        scores = answered.scored(scoring, goals_told)
        at = checkpoint_name(checkpoint)
        row = functools.partial(response_row, run.run_id, at, label, set_name, cfg.model.policy)
        return [
            row(prompts[c.prompt_index], c.sample_idx, text, score, threshold, math.nan, judge)
            for c, text, score in zip(answered.completions, answered.texts, scores, strict=True)
        ]

    for label, checkpoint in [("base", iteration), *victims]:
        who = BASE if label == "base" else DEFAULT_ROLE
        if who == DEFAULT_ROLE:
            policy.load_adapter(run.checkpoint_dir(checkpoint) / checkpoints.ADAPTER_FILE)
        sampler = functools.cache(lambda c=checkpoint: evaluation_sampler(run, policy, c))  # the engine: exported
        answer(sampler, who, label, checkpoint, HELDOUT, attacks, 1, told)
        answer(sampler, who, label, checkpoint, BENIGN, benign, samples, None)
    cross = None
    if rival is not None:
        own_on_base = [r for r in rows if r["policy"] == "base" and r["set"] == HELDOUT]
        refusals = load_refusals(cfg)  # the cross table's hardening pairs found attacks with them
        cross_parts = EvaluationParts(
            path.with_name(f"{stem}{versus}-cross.parquet"),
            {**settings, "against": rival.digest, "refusals": digest_of(refusals)},
        )
        cross = cross_attack(run, cfg, iteration, rival, policy, own, own_on_base, goals, samples, seed, answer,
                             cross_parts)  # fmt: skip
    labels = ["base", *(label for label, _ in victims)]
    embedder = diversity_embedder(cfg, device)
    figures = {label: victim_figures(rows, label, embedder, seed, threshold) for label in labels}
    base, final = figures["base"], figures[labels[-1]]
    path.parent.mkdir(exist_ok=True)
    rows_table = schemas.rows_to_table(rows, schemas.DEFENSE_EVALUATION, f"the active evaluation's rows ({path.name})")
    write_atomic(path, lambda tmp: pq.write_table(rows_table, tmp))
    result = ActiveEvaluation(
        run_id=run.run_id,
        checkpoint=name,
        path=str(path),
        goals=len(goals),
        samples_per_prompt=samples,  # attacks per goal; each victim answers each attack once
        attacks=len(attacks),
        judge=judge_label(judge),
        attacker=attacker_info.get("source"),
        policies=labels,
        figures=figures,
        victims={label: checkpoint_name(h) for label, h in victims},
        pruned=[checkpoint_name(h) for h in pruned],
        checks=OverRefusalCheck(
            **over_refusal_verdict(
                base.attack_success_rate,
                final.attack_success_rate,
                base.over_refusal,
                final.over_refusal,
                options.over_refusal_margin,
            )
        ),
        cross_attack=cross,
    )
    write_summary(path, result.summary_records(), judge_label(judge))
    parts.finish()
    if rival is not None:
        cross_parts.finish()
    log.info(
        "%s %s: the final attacker's success %.3f on the base, %.3f on the final victim (%s); over-refusal %.3f "
        "(base %.3f)",
        run.run_id,
        name,
        base.attack_success_rate,
        final.attack_success_rate,
        labels[-1],
        final.over_refusal,
        base.over_refusal,
    )
    return result
