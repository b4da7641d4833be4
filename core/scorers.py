"""Scorers: plain callables `(completions, prompts) -> list[float | None]`, one score per completion.

`None` means "no score" (the scorer failed on that text); the advantage stage gives such a sample advantage 0.
Every scorer has a `name` and a `revision`, stored next to its scores for lineage. The HTTP reward server
(a later stage of the project) implements the same protocol, so the trainer does not change when it drops in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from redteam_grpo.core.policy import resolve_model_name


class ScorerError(RuntimeError):
    """A scorer cannot be used as configured."""


class Scorer(Protocol):
    name: str
    revision: str

    def __call__(self, completions: Sequence[str], prompts: Sequence[str]) -> list[float | None]: ...


def _revision_of(path_or_id: str, model) -> str:
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return str(commit)
    config_file = Path(path_or_id) / "config.json"
    if config_file.is_file():
        return "local-" + hashlib.sha256(config_file.read_bytes()).hexdigest()[:12]
    return "unknown"


class SequenceClassifierScorer:
    """P(toxic_label) from a Hugging Face sequence classifier (DeBERTa-v3 toxicity, toxic-bert, ...)."""

    def __init__(
        self,
        name_or_path: str,
        toxic_label: str,
        device: torch.device,
        batch_size: int = 64,
        max_length: int = 512,
        revision: str | None = None,
    ) -> None:
        path = resolve_model_name(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, revision=revision).to(device).eval()
        labels = {str(v): int(k) for k, v in self.model.config.id2label.items()}
        if toxic_label not in labels:
            raise ScorerError(
                f"reward.toxic_label {toxic_label!r} is not a label of {name_or_path}; its labels are "
                f"{json.dumps(sorted(labels))}. Set reward.toxic_label to the one that means toxic."
            )
        self.toxic_index = labels[toxic_label]
        # One label with a sigmoid head (multi-label models like toxic-bert) vs softmax over classes.
        self.multi_label = self.model.config.problem_type == "multi_label_classification"
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.name = name_or_path
        self.revision = revision or _revision_of(path, self.model)

    @torch.no_grad()
    def __call__(self, completions: Sequence[str], prompts: Sequence[str] = ()) -> list[float | None]:
        scores: list[float | None] = []
        for start in range(0, len(completions), self.batch_size):
            texts = list(completions[start : start + self.batch_size])
            enc = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            logits = self.model(**enc).logits.float()
            probs = logits.sigmoid() if self.multi_label else logits.softmax(-1)
            scores.extend(float(p) for p in probs[:, self.toxic_index].cpu())
        return scores


def build_scorer(name_or_path: str, toxic_label: str, device: torch.device, batch_size: int, max_length: int):
    return SequenceClassifierScorer(name_or_path, toxic_label, device, batch_size, max_length)
