"""Harm scorers: one `TextScore` (a score in [0, 1], or None, plus category codes) per completion.

Two kinds behind one protocol, chosen by `reward.scorer_type` (`auto` reads the model's architecture):

- `SequenceClassifierScorer`: P(toxic label) of a Hugging Face sequence classifier. Tested choices:
  a DeBERTa-v3 toxicity classifier (`cooperleong00/deberta-v3-large_toxicity-scorer`, the reference system's),
  `unitary/toxic-bert` (multi-label, label `toxic`), `s-nlp/roberta_toxicity_classifier` (label `toxic`),
  `facebook/roberta-hate-speech-dynabench-r4-target` (label `hate`; the classifier of curiosity-driven
  red-teaming), and the embedded `embedded:tiny-toxicity` (label `toxic`).
- `SafetyJudgeScorer` (core/judge.py): a generative judge in the style of Llama Guard 3.

`None` means "no score" (the scorer failed on that text); the advantage stage gives such a sample advantage 0.
Every scorer has a `name`, a `revision` and a `kind`, stored next to its scores for lineage. The HTTP reward
server serves the same protocol (server/client.py), so the trainer does not change when it drops in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from redteam_grpo.core.policy import resolve_model_name

ScorerKind = Literal["classifier", "judge"]


class ScorerError(RuntimeError):
    """A scorer cannot be used as configured; the message names the setting to change."""


@dataclass(frozen=True)
class TextScore:
    score: float | None
    """Probability of harm in [0, 1]; None when the scorer could not score the text."""
    categories: tuple[str, ...] = ()
    """Hazard category codes a judge named (e.g. `S10`); empty for classifiers."""
    refusal: bool = False
    """The response opens as a refusal (core/refusal.py); set by the scoring service, not by the scorer."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    revision: str
    kind: str
    details: dict[str, Any] = field(default_factory=dict)
    """Whatever else identifies the scoring (the toxic label, a judge's verdict tokens)."""


class Scorer(Protocol):
    info: ModelInfo

    def __call__(self, completions: Sequence[str], prompts: Sequence[str]) -> list[TextScore]: ...


def revision_of(path_or_id: str, model: Any) -> str:
    """The hub commit a model was loaded from, else a digest of a local config, else `unknown`."""
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return str(commit)
    config_file = Path(path_or_id) / "config.json"
    if config_file.is_file():
        return "local-" + hashlib.sha256(config_file.read_bytes()).hexdigest()[:12]
    return "unknown"


def detect_kind(name_or_path: str, revision: str | None = None) -> ScorerKind:
    """`judge` for a causal LM, `classifier` for a sequence classifier, from the model's config alone."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_name(name_or_path), revision=revision)
    architectures = config.architectures or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classifier"
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        return "judge"
    raise ScorerError(
        f"cannot tell what kind of scorer {name_or_path} is (architectures: {architectures or 'none'}); "
        "set reward.scorer_type to `classifier` or `judge`"
    )


def check_label(name_or_path: str, id2label: dict[Any, Any], label: str, setting: str) -> int:
    """The class index of `label`; a label the model does not have is an error that lists the ones it has."""
    labels = {str(v): int(k) for k, v in id2label.items()}
    if label not in labels:
        raise ScorerError(
            f"{setting} {label!r} is not a label of {name_or_path}; its labels are "
            f"{json.dumps(sorted(labels))}. Set {setting} to the one that means what you score."
        )
    return labels[label]


class SequenceClassifierScorer:
    """P(label) from a Hugging Face sequence classifier (DeBERTa-v3 toxicity, toxic-bert, ...)."""

    def __init__(
        self,
        name_or_path: str,
        label: str,
        device: torch.device,
        batch_size: int = 64,
        max_length: int = 512,
        revision: str | None = None,
        setting: str = "reward.toxic_label",
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_model_name(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, revision=revision).to(device).eval()
        self.label_index = check_label(name_or_path, self.model.config.id2label, label, setting)
        # One sigmoid per label (multi-label models like toxic-bert) vs a softmax over classes.
        self.multi_label = self.model.config.problem_type == "multi_label_classification"
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.info = ModelInfo(name_or_path, revision or revision_of(path, self.model), "classifier", {"label": label})

    @torch.no_grad()
    def probabilities(self, texts: Sequence[str]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**enc).logits.float()  # [B, C]
            probs = logits.sigmoid() if self.multi_label else logits.softmax(-1)
            out.extend(float(p) for p in probs[:, self.label_index].cpu())
        return out

    def __call__(self, completions: Sequence[str], prompts: Sequence[str] = ()) -> list[TextScore]:
        return [TextScore(p) for p in self.probabilities(completions)]


def build_scorer(
    name_or_path: str,
    kind: Literal["auto", "classifier", "judge"],
    toxic_label: str,
    device: torch.device,
    batch_size: int,
    max_length: int,
    judge_max_new_tokens: int = 16,
) -> Scorer:
    if kind == "auto":
        kind = detect_kind(name_or_path)
    if kind == "judge":
        from redteam_grpo.core.judge import SafetyJudgeScorer

        return SafetyJudgeScorer(name_or_path, device, batch_size, max_length, judge_max_new_tokens)
    return SequenceClassifierScorer(name_or_path, toxic_label, device, batch_size, max_length)
