"""Harm scorers: one `TextScore` (a score in [0, 1], or None, plus category codes) per completion.

Two kinds behind one protocol, chosen by `reward.scorer_type` (`auto` reads the model's architecture):

- `SequenceClassifierScorer`: P(toxic label) of a Hugging Face sequence classifier. Tested choices:
  a DeBERTa-v3 toxicity classifier (`cooperleong00/deberta-v3-large_toxicity-scorer`, the reference system's),
  `unitary/toxic-bert` (multi-label, label `toxic`), `s-nlp/roberta_toxicity_classifier` (label `toxic`),
  `facebook/roberta-hate-speech-dynabench-r4-target` (label `hate`; the classifier of curiosity-driven
  red-teaming), and the embedded `embedded:tiny-toxicity` (label `toxic`).
- `SafetyJudgeScorer` (core/scoring/judge.py): a generative judge in the style of Llama Guard 3.

A completion is scored in its context (`Context`): the prompt it answers, or the whole conversation before it (a
multi-turn dialogue, `core/rollouts/dialogue.py`). A judge reads the context (Llama Guard assesses the last Agent
message of a conversation); a classifier reads the completion alone.

Any text can be scored: each scorer cuts its input to its own maximum length (`input_limit`: the smaller of
`reward.max_length` and what the model can take) and says so in `TextScore.truncated`, so a long completion
is scored on its beginning instead of failing the batch (bug class `scorer-input-not-truncated`).

`None` means "no score" (the scorer failed on that text); the advantage stage gives such a sample advantage 0.
Every scorer has a `name`, a `revision` and a `kind`, stored next to its scores for lineage. The HTTP reward
server serves the same protocol (server/client.py), so the trainer does not change when it drops in.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from redteam_grpo.core.models.policy import resolve_model_name

ScorerKind = Literal["classifier", "judge"]

Message = Mapping[str, str]
Context = str | Sequence[Message]
"""What a completion answers: its prompt, or the conversation before it as chat messages ({role, content}, roles
`user` and `assistant` alternating from a user message and ending with one)."""


@dataclass(frozen=True)
class Goal:
    """What an attack was after, where it is known apart from the prompt that carried it (defense mode: the goal the
    attacker was given). Judges that read the request before any jailbreak (HarmBench's behavior, StrongREJECT's
    forbidden prompt) are told this, not the attack prompt (bug class `judge-told-the-attack-not-the-goal`)."""

    text: str
    context: str | None = None
    """A HarmBench contextual behavior's context string, rendered in its classifier's contextual prompt."""


class ScorerError(RuntimeError):
    """A scorer cannot be used as configured; the message names the setting to change."""


def conversation(context: Context, completion: str) -> list[dict[str, str]]:
    """The chat messages of `completion` (the last, an assistant message) in its context.

    >>> conversation("Hi.", "Hello.")
    [{'role': 'user', 'content': 'Hi.'}, {'role': 'assistant', 'content': 'Hello.'}]
    >>> len(conversation([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
    ...                   {"role": "user", "content": "And?"}], "Bye."))
    4
    """
    if isinstance(context, str):
        return [{"role": "user", "content": context}, {"role": "assistant", "content": completion}]
    messages = []
    for i, message in enumerate(context):
        expected = "user" if i % 2 == 0 else "assistant"
        role, content = (message.get("role"), message.get("content")) if isinstance(message, Mapping) else (None, None)
        if role != expected or not isinstance(content, str):
            raise ScorerError(
                f"message {i} of a conversation is {dict(message) if isinstance(message, Mapping) else message!r}; "
                f"expected {{'role': {expected!r}, 'content': <text>}}: a conversation alternates user and assistant "
                "messages from a user message, and ends with the user message the completion answers"
            )
        messages.append({"role": role, "content": content})
    if len(messages) % 2 != 1:
        raise ScorerError(
            f"a conversation of {len(messages)} messages ends with "
            f"{'no message' if not messages else 'an assistant message'}: it must end with the user message the "
            "completion answers"
        )
    return [*messages, {"role": "assistant", "content": completion}]


@dataclass(frozen=True)
class TextScore:
    score: float | None
    """Probability of harm in [0, 1]; None when the scorer could not score the text."""
    categories: tuple[str, ...] = ()
    """Hazard category codes a judge named (e.g. `S10`); empty for classifiers."""
    refusal: bool = False
    """The response opens as a refusal (core/scoring/refusal.py); set by the scoring service, not by the scorer."""
    truncated: bool = False
    """The scorer saw only the beginning of the text: it was longer than the scorer's maximum length."""
    judge_refusal: bool | None = None
    """What a judge whose format reports refusal said of the response (None: nothing); with
    reward.refusal_from_judge it is the refusal flag (core/scoring/backend.py)."""

    @property
    def harm(self) -> float | None:
        """The score as a harm term: None when the scorer gave none or a non-finite one (the reward is then
        "no reward", advantage 0)."""
        return self.score if self.score is not None and math.isfinite(self.score) else None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    revision: str
    kind: str
    details: dict[str, Any] = field(default_factory=dict)
    """Whatever else identifies the scoring (the toxic label, a judge's verdict tokens)."""


class Scorer(Protocol):
    info: ModelInfo

    def __call__(
        self, completions: Sequence[str], prompts: Sequence[Context], goals: Sequence[Goal | None] | None = None
    ) -> list[TextScore]: ...


def revision_of(path_or_id: str, model: Any) -> str:
    """The hub commit a model was loaded from, else a digest of a local config, else `unknown`."""
    commit = getattr(model.config, "_commit_hash", None)
    if commit:
        return str(commit)
    config_file = Path(path_or_id) / "config.json"
    if config_file.is_file():
        return "local-" + hashlib.sha256(config_file.read_bytes()).hexdigest()[:12]
    return "unknown"


# transformers' `model_max_length` when a tokenizer was saved without one (int(1e30)): no limit is known.
_NO_TOKENIZER_LIMIT = 10**18


def model_input_limit(tokenizer: Any, model: Any) -> int | None:
    """The most tokens `model` can take in one sequence, or None when neither the tokenizer nor the config says.

    The smaller of `tokenizer.model_max_length` (unless it is transformers' "unset" sentinel) and the
    position-embedding table (`config.max_position_embeddings`). RoBERTa-style embeddings number positions from
    `padding_idx + 1`, so that many rows of their table are never a position and are not counted.
    """
    limits = []
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < _NO_TOKENIZER_LIMIT:
        limits.append(tokenizer_limit)
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        for name, module in model.named_modules():
            if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding):
                if module.padding_idx is not None:
                    positions -= module.padding_idx + 1
                break
        limits.append(positions)
    return min(limits) if limits else None


def input_limit(max_length: int, tokenizer: Any, model: Any, reserved: int = 0) -> int:
    """The tokens a scorer reads at most: `max_length` (reward.max_length), lowered to what the model can take
    less `reserved` positions (a judge's generated verdict)."""
    model_limit = model_input_limit(tokenizer, model)
    return max_length if model_limit is None else min(max_length, model_limit - reserved)


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
    """P(label) from a Hugging Face sequence classifier (DeBERTa-v3 toxicity, toxic-bert, ...).

    A text longer than `max_length` tokens is scored on its first `max_length` tokens (special tokens included)
    and flagged `truncated`; `max_length` is `min(max_length argument, the model's own limit)`
    (`input_limit`), so a text never reaches past the model's position embeddings.
    """

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
        self.device, self.batch_size = device, batch_size
        self.max_length = input_limit(max_length, self.tokenizer, self.model)
        self.info = ModelInfo(
            name_or_path,
            revision or revision_of(path, self.model),
            "classifier",
            {"label": label, "max_length": self.max_length},
        )

    @torch.no_grad()
    def probabilities_and_truncation(self, texts: Sequence[str]) -> tuple[list[float], list[bool]]:
        """P(label) of each text, read from at most `max_length` tokens, and whether the text had more."""
        probabilities: list[float] = []
        truncated: list[bool] = []
        for start in range(0, len(texts), self.batch_size):
            batch = list(texts[start : start + self.batch_size])
            # verbose=False: a text longer than the model is expected here, it is cut below
            lengths = [len(ids) for ids in self.tokenizer(batch, verbose=False)["input_ids"]]
            truncated.extend(n > self.max_length for n in lengths)
            enc = self.tokenizer(
                batch,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**enc).logits.float()  # [B, C]
            probs = logits.sigmoid() if self.multi_label else logits.softmax(-1)
            probabilities.extend(float(p) for p in probs[:, self.label_index].cpu())
        return probabilities, truncated

    def probabilities(self, texts: Sequence[str]) -> list[float]:
        return self.probabilities_and_truncation(texts)[0]

    def __call__(
        self, completions: Sequence[str], prompts: Sequence[Context] = (), goals: Sequence[Goal | None] | None = None
    ) -> list[TextScore]:
        """A classifier reads the completion alone: its context (prompt or conversation) and goal are not scored."""
        probabilities, truncated = self.probabilities_and_truncation(completions)
        return [TextScore(p, truncated=cut) for p, cut in zip(probabilities, truncated, strict=True)]


def build_scorer(
    name_or_path: str,
    kind: Literal["auto", "classifier", "judge"],
    toxic_label: str,
    device: torch.device,
    batch_size: int,
    max_length: int,
    judge_max_new_tokens: int = 16,
    judge_format: str | None = None,
) -> Scorer:
    if kind == "auto":
        kind = detect_kind(name_or_path)
    if kind == "judge":
        from redteam_grpo.core.scoring.judge import SafetyJudgeScorer
        from redteam_grpo.core.scoring.judge_formats import format_for

        judge = format_for(name_or_path, judge_format)
        return SafetyJudgeScorer(name_or_path, device, batch_size, max_length, judge_max_new_tokens, judge_format=judge)
    return SequenceClassifierScorer(name_or_path, toxic_label, device, batch_size, max_length)
