"""The scoring service: a harm scorer, the refusal detector and (for novelty) an embedder, behind one protocol.

`LocalScoring` runs them in the trainer's process; `server.client.RewardClient` asks the HTTP reward server,
which wraps a `LocalScoring` of its own. The score stage only sees the protocol, so `reward.url` switches
between the two with no other change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from redteam_grpo.core.config import RewardConfig
from redteam_grpo.core.scoring.refusal import RefusalDetector
from redteam_grpo.core.scoring.scorers import (
    Context,
    Goal,
    ModelInfo,
    Scorer,
    ScorerError,
    SequenceClassifierScorer,
    TextScore,
    build_scorer,
)


@dataclass(frozen=True)
class ServiceInfo:
    scorer: ModelInfo
    embedder: ModelInfo | None
    refusal: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ScoringBackend(Protocol):
    def describe(self) -> ServiceInfo: ...

    def score(
        self, completions: Sequence[str], prompts: Sequence[Context], goals: Sequence[Goal | None] | None = None
    ) -> list[TextScore]: ...

    def embed(self, texts: Sequence[str]) -> torch.Tensor: ...


class LocalScoring:
    def __init__(
        self, scorer: Scorer, refusal: RefusalDetector, embedder=None, refusal_info=None, refusal_from_judge=False
    ) -> None:
        self.scorer, self.refusal, self.embedder = scorer, refusal, embedder
        self.refusal_info = refusal_info or {"patterns": True, "classifier": None}
        self.refusal_from_judge = refusal_from_judge

    def describe(self) -> ServiceInfo:
        return ServiceInfo(self.scorer.info, self.embedder.info if self.embedder else None, self.refusal_info)

    def score(
        self, completions: Sequence[str], prompts: Sequence[Context], goals: Sequence[Goal | None] | None = None
    ) -> list[TextScore]:
        scores = self.scorer(completions, prompts, goals)
        if len(scores) != len(completions):
            raise ScorerError(f"scorer {self.scorer.info.name} returned {len(scores)} scores for {len(completions)}")
        flags = self.refusal(completions)
        if self.refusal_from_judge:  # the judge's verdict where it gave one
            flags = [f if s.judge_refusal is None else s.judge_refusal for s, f in zip(scores, flags, strict=True)]
        return [dataclasses.replace(s, refusal=f) for s, f in zip(scores, flags, strict=True)]

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        if self.embedder is None:
            raise ScorerError("no embedder is loaded: novelty needs reward.embedder (server: --embedder)")
        return self.embedder(texts)


def build_local_scoring(cfg: RewardConfig, device: torch.device, with_embedder: bool | None = None) -> LocalScoring:
    """Load what `cfg` names; the embedder only when novelty is weighted (or `with_embedder` says so)."""
    scorer = build_scorer(
        cfg.scorer,
        cfg.scorer_type,
        cfg.toxic_label,
        device,
        cfg.batch_size,
        cfg.max_length,
        cfg.judge_max_new_tokens,
        cfg.judge_format,
    )
    classifier = None
    if cfg.refusal_classifier:
        classifier = SequenceClassifierScorer(
            cfg.refusal_classifier,
            cfg.refusal_label,
            device,
            cfg.batch_size,
            cfg.max_length,
            setting="reward.refusal_label",
        )
    refusal_info = {
        "patterns": True,
        "classifier": classifier.info.name if classifier else None,
        "label": cfg.refusal_label if classifier else None,
    }
    if cfg.refusal_from_judge:
        check_refusal_from_judge(cfg, scorer.info)
        refusal_info["judge"] = scorer.info.details["format"]
    detector = RefusalDetector(classifier.probabilities if classifier else None)
    embedder = None
    if with_embedder if with_embedder is not None else cfg.novelty_weight != 0.0:
        from redteam_grpo.core.scoring.novelty import SentenceEmbedder

        embedder = SentenceEmbedder(cfg.embedder, device, cfg.batch_size)
    return LocalScoring(scorer, detector, embedder, refusal_info, cfg.refusal_from_judge)


def check_refusal_from_judge(cfg: RewardConfig, scorer: ModelInfo | None = None) -> None:
    """reward.refusal_from_judge needs a judge whose format reports refusal; the error names the ones that do."""
    from redteam_grpo.core.scoring.judge_formats import format_for, formats_reporting

    if scorer is not None and scorer.kind != "judge":
        problem = "is a classifier"
    else:
        judge = format_for(cfg.scorer, cfg.judge_format)
        if "refusal" in judge.reports:
            return
        problem = f"is read in the {judge.name} format, which says nothing of refusals"
    raise ScorerError(
        f"reward.refusal_from_judge needs a judge whose verdict says whether a response refuses "
        f"(reward.judge_format {', '.join(formats_reporting('refusal'))}); reward.scorer {cfg.scorer} {problem}"
    )


def preflight(cfg: RewardConfig) -> None:
    """Fail fast on what can be checked from model configs alone: the scorer's kind and the labels."""
    from transformers import AutoConfig

    from redteam_grpo.core.models.policy import resolve_model_name
    from redteam_grpo.core.scoring.judge_formats import format_for
    from redteam_grpo.core.scoring.scorers import check_label, detect_kind

    try:
        kind = cfg.scorer_type if cfg.scorer_type != "auto" else detect_kind(cfg.scorer)
        if kind == "classifier":
            config = AutoConfig.from_pretrained(resolve_model_name(cfg.scorer))
            check_label(cfg.scorer, config.id2label, cfg.toxic_label, "reward.toxic_label")
        else:
            format_for(cfg.scorer, cfg.judge_format)  # a judge whose format is unknown is named now
        if cfg.refusal_from_judge:
            check_refusal_from_judge(cfg, ModelInfo(cfg.scorer, "", kind, {}))
        if cfg.refusal_classifier:
            config = AutoConfig.from_pretrained(resolve_model_name(cfg.refusal_classifier))
            check_label(cfg.refusal_classifier, config.id2label, cfg.refusal_label, "reward.refusal_label")
    except OSError as exc:  # not a folder, not in the local cache (offline), no config.json
        raise ScorerError(f"cannot load the scorer's config: {exc}") from None
