"""Evaluation of a finished (or running) run's checkpoint against the base model; the `evaluation` deployment in
prefect.yaml runs it on demand. Writes RUN/eval/<checkpoint>.parquet and a Prefect artifact."""

from __future__ import annotations

from prefect import flow

from redteam_grpo.core.evaluation import EvaluationOptions, EvaluationResult
from redteam_grpo.flows.deployment_guard import check_evaluation_request, from_a_deployment
from redteam_grpo.storage import ownership
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.tasks.artifacts import publish_evaluation
from redteam_grpo.tasks.evaluate import evaluate_checkpoint
from redteam_grpo.tasks.evaluate_active import evaluate_active
from redteam_grpo.tasks.evaluate_defense import evaluate_defense

# What `evaluate` measures, by the run's mode's `evaluation` (storage/modes.py).
EVALUATIONS = {"redteam": evaluate_checkpoint, "defense": evaluate_defense, "active": evaluate_active}


@flow(name="redteam-evaluate", log_prints=True)
def evaluate(run_dir: str, options: EvaluationOptions | None = None, artifacts: bool = True) -> EvaluationResult:
    """Red-team runs: attack success rate, mean harm score and refusal rate of the checkpoint after
    `options.iteration` (default: the newest) and of the base model, on `num_prompts` prompts the run did not
    sample, `samples_per_prompt` each; success: harm >= `success_threshold` and not a refusal; quality@tau and
    diversity (tasks/evaluate.py).

    Defense runs (tasks/evaluate_defense.py): the defended model and its base side by side: unsafe share on
    `heldout_goals` (the run's attacker writes the prompts) and on `prompt_file`, over-refusal on `benign`, and
    capability retention (KL to the base on `benign`, perplexity of `retention`'s reference replies). A defense is
    flagged when its over-refusal exceeds the base's by more than `over_refusal_margin` or its perplexity the base's
    by more than the factor `perplexity_limit`.

    Active Attacks runs (tasks/evaluate_active.py): the final attacker against the base and each round's victim on
    `heldout_goals`, with the count and diversity of its distinct successful attacks, and each victim's over-refusal
    on `benign`; with `against` (another run's attacker on the same base), the cross-attack table. SFT runs are
    refused (their held-out loss is in their metrics).

    Returns the evaluation's typed result (core/evaluation.py: `RedteamEvaluation`, `DefenseEvaluation`,
    `ActiveEvaluation`)."""
    options = options or EvaluationOptions()
    if from_a_deployment():  # an evaluation writes into the run: one of the worker's runs folder
        check_evaluation_request(run_dir, options.against)
    run = RunDir.open(run_dir)
    evaluation = mode_of(run.stored_config()).evaluation
    # one evaluation of a run at a time (its RUN/eval files); the run's owner may go on training beside it
    with ownership.owning(run.root, ownership.DERIVED):
        result = EVALUATIONS.get(evaluation, evaluate_checkpoint)(run_dir, options)  # red-team's refuses SFT runs
    if artifacts:
        publish_evaluation(result)
    return result
