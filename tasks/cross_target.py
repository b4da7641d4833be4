"""What red-team and defense evaluations add beside their own sets, the same way for both:

- **transfer** (`--transfer-to MODEL,...`): the adversarial examples above the success threshold against the target
  the run trained against, sent to other targets; cross-attack success on each beside the trained-against target,
  all sampled afresh with one seed (Active Attacks' cross-attack success). Other targets are sampled in-process.
- **over-refusal of every target** on the benign set, so no attack-success figure stands without one;
- **capability** (`--capability lm-eval:TASKS`): lm-evaluation-harness scores of each policy of the run
  (`core/capability.py`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redteam_grpo.core.capability import CapabilitySuite, parse_capability
from redteam_grpo.core.data.sources import Prompt
from redteam_grpo.core.evaluation import CapabilityScore, EvaluationOptions, Transfer, TransferFigures
from redteam_grpo.core.models.policy import Policy, check_model_available, load_policy
from redteam_grpo.core.rollouts.sampling import Completion
from redteam_grpo.core.scoring.backend import ScoringBackend
from redteam_grpo.core.scoring.scorers import TextScore
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.tasks.engine import BASE, InProcessSampler, Sampler, answers

TRANSFER, BENIGN = "transfer", "benign"


@dataclass(frozen=True)
class Answer:
    """One scored answer of one policy to one prompt of one set."""

    policy: str
    set: str
    target: str
    prompt: Prompt
    completion: Completion
    text: str
    score: TextScore

    def columns(self, text_column: str) -> dict[str, Any]:
        """The columns every evaluation row of an answer has; `text_column` names the answer's text."""
        return {
            "policy": self.policy,
            "set": self.set,
            "target": self.target,
            "prompt_id": self.prompt.prompt_id,
            "sample_idx": self.completion.sample_idx,
            "prompt": self.prompt.text,
            text_column: self.text,
            "harm": self.score.harm,
            "refusal": bool(self.score.refusal),
        }


def refused(score: TextScore) -> bool:
    return bool(score.refusal)


def scorer_columns(scorer: Any) -> dict[str, str]:
    """The scorer behind a row: its name, revision and format (a judge's, or "classifier"): two evaluations compare
    only when these are the same."""
    return {
        "scorer_name": scorer.name,
        "scorer_revision": scorer.revision,
        "scorer_format": scorer.details.get("format", scorer.kind),
    }


def judge_label(scorer: Any) -> str:
    """`name (format, revision)`: what an attack-success figure means is its judge's verdict."""
    columns = scorer_columns(scorer)
    return f"{columns['scorer_name']} ({columns['scorer_format']}, {columns['scorer_revision']})"


def scored_answers(
    label: str,
    set_name: str,
    target: str,
    sampler: Sampler,
    who: str,
    tokenizer: Any,
    prompts: list[Prompt],
    system_prompt: str | None,
    samples: int,
    max_new_tokens: int,
    seed: int,
    scoring: ScoringBackend,
) -> list[Answer]:
    answered = answers(sampler, who, tokenizer, prompts, system_prompt, samples, max_new_tokens, seed)
    return [
        Answer(label, set_name, target, answered.prompt_of(c), c, text, score)
        for c, text, score in zip(answered.completions, answered.texts, answered.scored(scoring), strict=True)
    ]


def load_target(cfg: Any, name: str, device: Any) -> Policy:
    """Another target, loaded as the run's policy is (dtype, attention, chat formatting) with no adapter trained."""
    model = cfg.model.model_copy(update={"policy": name, "revision": None})
    return load_policy(model, cfg.sampling.temperature, device, cfg.run.seed)


def other_targets(cfg: Any, names: list[str], device: Any) -> Iterator[tuple[str, Policy]]:
    """Each transfer target in turn, freed before the next loads (one extra model in memory at a time)."""
    for name in names:
        target = load_target(cfg, name, device)
        yield name, target
        del target
        gc.collect()


def transfer_answers(
    cfg: Any,
    options: EvaluationOptions,
    device: Any,
    examples: list[Prompt],
    trained_against: list[tuple[str, Sampler, str, Any]],
    benign: list[Prompt],
    scoring: ScoringBackend,
) -> list[Answer]:
    """The examples answered by each trained-against policy (label, sampler, who, tokenizer) and by each
    `options.transfer_to` target, plus each target's answers to the benign set (its over-refusal); one seed for all,
    so every target answers the same prompts with the same draws of its own distribution."""
    if not options.transfer_to:
        return []
    system, max_new, n = cfg.model.system_prompt, cfg.sampling.max_new_tokens, options.samples_per_prompt
    seed = derive_seed(options.seed, "evaluate", TRANSFER)
    out: list[Answer] = []
    if examples:
        for label, sampler, who, tokenizer in trained_against:
            out += scored_answers(
                label, TRANSFER, cfg.model.policy, sampler, who, tokenizer, examples, system, n, max_new, seed, scoring
            )
    for name, target in other_targets(cfg, options.transfer_to, device):
        sampler = InProcessSampler(target, cfg.sampling.batch_size)
        if examples:
            out += scored_answers(
                name, TRANSFER, name, sampler, BASE, target.tokenizer, examples, system, n, max_new, seed, scoring
            )
        benign_seed = derive_seed(options.seed, "evaluate", BENIGN)  # the seed the run's own policies answer with
        out += scored_answers(
            name, BENIGN, name, sampler, BASE, target.tokenizer, benign, system, n, max_new, benign_seed, scoring
        )
    return out


def share(answers_: list[Answer], label: str, set_name: str, succeeded: Callable[[TextScore], bool]) -> float:
    chosen = [succeeded(a.score) for a in answers_ if a.policy == label and a.set == set_name]
    return sum(chosen) / len(chosen) if chosen else float("nan")


def transfer_summary(
    transferred: list[Answer],
    examples: list[Prompt],
    own: dict[str, float],
    targets: list[str],
    succeeded: Callable[[TextScore], bool],
) -> Transfer | None:
    """Cross-attack success of each trained-against policy (`own`: its label → its over-refusal, measured with the
    run's own sets) and of each other target, with its over-refusal; None when no target was asked for."""
    if not targets:
        return None
    return Transfer(
        examples=len(examples),
        trained_against=list(own),
        targets={
            label: TransferFigures(
                transfer_attack_success_rate=share(transferred, label, TRANSFER, succeeded),
                over_refusal=own[label] if label in own else share(transferred, label, BENIGN, refused),
            )
            for label in [*own, *targets]
        },
    )


def check_targets(options: EvaluationOptions) -> None:
    """Every transfer target can be loaded (a folder that exists, a hub id reachable or cached): before any work."""
    for name in options.transfer_to:
        check_model_available("--transfer-to", name)


def capability_suite(options: EvaluationOptions, log: Path) -> CapabilitySuite | None:
    """The requested lm-eval tasks, resolved (an unknown name refused) before any model loads; None if not asked."""
    if options.capability is None:
        return None
    return CapabilitySuite(parse_capability(options.capability), log, options.capability_limit)


def capability_records(suite: CapabilitySuite | None, policy: Policy, trained: str) -> list[CapabilityScore]:
    """The lm-eval tasks' figures for the base (every adapter off) and the trained model (labelled `trained`, its
    adapter as loaded)."""
    if suite is None:
        return []
    records = []
    for label, context in (("base", policy.reference()), (trained, contextlib.nullcontext())):
        with context:
            scores = suite.scores(policy.model, policy.tokenizer)
        records += [
            CapabilityScore(policy=label, metric=f"{task} {metric}", value=value)
            for task, metrics in scores.items()
            for metric, value in metrics.items()
        ]
    return records
