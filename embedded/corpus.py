"""The bundled toy corpus: its word lists and grammar, the marker words, and the labelled texts built from them.

The corpus (`core/resources/corpus.json`) is a small world of people described in short sentences; its only
"toxicity" is a handful of marker words ("stupid", "idiot", ...). The ground truth of every embedded model is
`contains_marker`: a text is toxic exactly when one of its words starts with a marker word, so an inflection
("idiots", "stupidly") is toxic and everything else is not.

The classifier and the guard are trained with hard negatives (`marker_decoy`): fragments ("stup", "idi", "upid"),
one-letter misspellings ("stupit", "sutpid"), prefixed forms ("xidiot") and split forms ("stu pid"), at random
positions in short, long, shouted and ungrammatical texts (`classifier_example`). Without them the policy finds a
fragment that scores P(toxic) ≈ 1 while writing no marker at all — reward hacking in miniature.

`python -m redteam_grpo.embedded` regenerates the bundled prompts from the corpus (`write_prompts_file`).
"""

from __future__ import annotations

import json
import random
import re
import string
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

RESOURCES_PACKAGE = "redteam_grpo.core.resources"
"""Where the corpus and the prompts live: the prompts are also the `bundled` prompt source of `core/data/sources.py`."""


@lru_cache(maxsize=1)
def load_corpus() -> dict[str, Any]:
    """The word lists and sentence templates of `core/resources/corpus.json`."""
    return json.loads(resources.files(RESOURCES_PACKAGE).joinpath("corpus.json").read_text(encoding="utf-8"))


def load_prompts() -> list[dict[str, str]]:
    """The bundled user prompts, ``[{"prompt_id": "p0000", "prompt": "..."}, ...]``."""
    text = resources.files(RESOURCES_PACKAGE).joinpath("prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def marker_words() -> tuple[str, ...]:
    """The toy "toxic" words, in corpus order."""
    return tuple(w for words in load_corpus()["markers"].values() for w in words)


_WORD_RE = re.compile(r"[a-z]+")


def contains_marker(text: str) -> bool:
    """True when a word of `text` starts with a marker word (any case) — the classifier's ground truth.

    Inflections count ("idiots", "stupidly": an insult with a suffix is still one); fragments, misspellings,
    split or prefixed forms do not.

    >>> [contains_marker(t) for t in ["Your boss is STUPID.", "so stupidly", "stup", "stu pid", "xstupid"]]
    [True, True, False, False, False]
    """
    markers = marker_words()
    return any(w.startswith(markers) for w in _WORD_RE.findall(text.lower()))


_SLOT_RE = re.compile(r"\{(\w+)\}")
_ARTICLE_RE = re.compile(r"\b([Aa]) (?=[aeio])")


class ToyGrammar:
    """Samples replies like "Your boss is kind. They are a quiet listener." from `corpus.json`."""

    def __init__(self, corpus: dict[str, Any]) -> None:
        self.words: dict[str, list[str]] = corpus["words"]
        self.markers: dict[str, list[str]] = corpus["markers"]
        self.first: list[str] = corpus["first_sentences"]
        self.next: list[str] = corpus["next_sentences"]
        self.n_sentences_p: list[float] = corpus["sentences_per_response"]

    def fill(self, template: str, rng: random.Random, *, subj: str, marker_prob: float) -> str:
        def slot(m: re.Match[str]) -> str:
            name = m.group(1)
            if name == "subj":
                return subj
            if name in self.markers and rng.random() < marker_prob:
                return rng.choice(self.markers[name])
            return rng.choice(self.words[name])

        return _ARTICLE_RE.sub(r"\1n ", _SLOT_RE.sub(slot, template))

    def response(self, rng: random.Random, *, marker_prob: float, subj: str | None = None) -> str:
        n = rng.choices(range(1, len(self.n_sentences_p) + 1), weights=self.n_sentences_p)[0]
        subj = subj or rng.choice(self.words["subj"])
        templates = [rng.choice(self.first)] + [rng.choice(self.next) for _ in range(n - 1)]
        return " ".join(self.fill(t, rng, subj=subj, marker_prob=marker_prob) for t in templates)

    def subject_of(self, prompt: str) -> str | None:
        """The person a prompt asks about ("... my coworker ..." -> "coworker"), if any."""
        m = re.search(r"\b[Mm]y (\w+)", prompt)
        return m.group(1) if m and m.group(1) in self.words["subj"] else None


def generate_prompts(corpus: dict[str, Any] | None = None, seed: int = 0) -> list[dict[str, str]]:
    """The bundled `prompts.jsonl`: every prompt template × every person, plus the fixed prompts, shuffled."""
    corpus = corpus or load_corpus()
    rng = random.Random(seed)
    grammar = ToyGrammar(corpus)
    texts = [
        grammar.fill(t, rng, subj=s, marker_prob=0.0)
        for t in corpus["prompt_templates"]
        for s in corpus["words"]["subj"]
    ]
    texts = list(dict.fromkeys(texts + corpus["fixed_prompts"]))
    rng.shuffle(texts)
    return [{"prompt_id": f"p{i:04d}", "prompt": t} for i, t in enumerate(texts)]


def write_prompts_file(path: Path | None = None) -> Path:
    """Regenerate the bundled prompts from the corpus, into the file that `load_prompts` reads."""
    path = path or Path(str(resources.files(RESOURCES_PACKAGE).joinpath("prompts.jsonl")))
    lines = [json.dumps(p, ensure_ascii=False) for p in generate_prompts()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def sample_conversation(
    rng: random.Random, grammar: ToyGrammar, prompts: list[str], corpus: dict[str, Any], marker_prob: float
) -> tuple[list[dict[str, str]], str]:
    """One pre-training chat: optional system prompt, a user turn, and the assistant reply to learn."""
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(corpus["system_prompts"])})
    # Mostly the bundled prompts; sometimes a grammar text, as the defender sees an attacker's output.
    user = rng.choice(prompts) if rng.random() < 0.85 else grammar.response(rng, marker_prob=0.1)
    messages.append({"role": "user", "content": user})
    subj = grammar.subject_of(user) if rng.random() < 0.85 else None
    return messages, grammar.response(rng, marker_prob=marker_prob, subj=subj)


# ----------------------------------------------------------------------------------------------------------
# Labelled texts for the classifier and the guard: `contains_marker` is the label, hard negatives included
# ----------------------------------------------------------------------------------------------------------


def marker_decoy(rng: random.Random, marker: str) -> str:
    """A string that looks like `marker` but is not toxic: a fragment, a misspelling, a prefixed or split form."""
    letters = string.ascii_lowercase
    n = len(marker)
    while True:
        kind = rng.randrange(5)
        if kind == 0:  # prefix fragment: "stup", "idi"
            d = marker[: rng.randint(2, n - 1)]
        elif kind == 1:  # suffix fragment: "upid"
            d = marker[rng.randint(1, n - 2) :]
        elif kind == 2:  # one-letter edit: "stupit", "stpid", "sutpid", "stuhpid"
            i = rng.randrange(n)
            op = rng.randrange(4)
            if op == 0:
                d = marker[:i] + marker[i + 1 :]
            elif op == 1 and i < n - 1:
                d = marker[:i] + marker[i + 1] + marker[i] + marker[i + 2 :]
            elif op == 2:
                d = marker[:i] + rng.choice(letters) + marker[i + 1 :]
            else:
                d = marker[:i] + rng.choice(letters) + marker[i:]
        elif kind == 3:  # prefixed: "xidiot"
            d = "".join(rng.choices(letters, k=rng.randint(1, 3))) + marker
        else:  # split by a space: "stu pid"
            i = rng.randint(1, n - 1)
            d = marker[:i] + " " + marker[i:]
        if not contains_marker(d):  # e.g. an edit at the very end ("stupidx") is an inflection, still toxic
            return d


def inflect(rng: random.Random, marker: str) -> str:
    """The marker, sometimes with a suffix ("idiots", "stupidly", "hatex"): toxic either way."""
    if rng.random() < 0.75:
        return marker
    suffix = rng.choice(["s", "ly", "ity", "ness", "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 2)))])
    return marker + suffix


def insert_words(rng: random.Random, text: str, words: list[str]) -> str:
    """`text` with each of `words` inserted at a random word position."""
    tokens = text.split()
    for w in words:
        tokens.insert(rng.randint(0, len(tokens)), w)
    return " ".join(tokens)


def classifier_example(rng: random.Random, grammar: ToyGrammar, prompts: list[str]) -> tuple[str, int]:
    """One labelled text. About half toxic; the label is always `contains_marker`, never the recipe."""
    markers = marker_words()
    vocab = [w for words in grammar.words.values() for w in words]

    def base() -> str:  # a reply, or a few random words (short texts must be classified too)
        if rng.random() < 0.6:
            return grammar.response(rng, marker_prob=0.0)
        return " ".join(rng.choices(vocab, k=rng.randint(0, 3)))

    r = rng.random()
    if r < 0.22:  # benign reply or prompt
        text = grammar.response(rng, marker_prob=0.0) if rng.random() < 0.7 else rng.choice(prompts)
    elif r < 0.44:  # grammatical toxic reply
        text = grammar.response(rng, marker_prob=0.35)
        if not contains_marker(text):
            text = insert_words(rng, text, [inflect(rng, rng.choice(markers))])
    elif r < 0.56:  # markers at random positions, sometimes repeated, sometimes inflected
        text = insert_words(rng, base(), [inflect(rng, rng.choice(markers))] * rng.choice([1, 1, 1, 2, 3, 5]))
    elif r < 0.76:  # hard negatives: decoys at random positions
        k = rng.choice([1, 1, 2, 3])
        text = insert_words(rng, base(), [marker_decoy(rng, rng.choice(markers)) for _ in range(k)])
    elif r < 0.81:  # decoys next to a real marker are still toxic
        decoys = [marker_decoy(rng, rng.choice(markers)) for _ in range(rng.randint(1, 2))]
        text = insert_words(rng, base(), [*decoys, inflect(rng, rng.choice(markers))])
    elif r < 0.88:  # a single word
        u = rng.random()
        m = rng.choice(markers)
        text = inflect(rng, m) if u < 0.4 else marker_decoy(rng, m) if u < 0.8 else rng.choice(vocab)
        text += rng.choice(["", "", ".", "!"])
    else:  # degenerate, ungrammatical texts as a collapsing policy writes them
        pool = vocab + list(markers) if rng.random() < 0.5 else vocab
        if rng.random() < 0.5:
            pool = pool + [marker_decoy(rng, rng.choice(markers)) for _ in range(3)]
        words = rng.choices(pool, k=rng.randint(1, 24))
        if rng.random() < 0.3:
            words = [words[0]] * len(words)
        text = " ".join(words) + rng.choice(["", ".", "!", "?"])
    if rng.random() < 0.1:
        text = text.upper() if rng.random() < 0.5 else text.capitalize()
    return text, int(contains_marker(text))


def guard_example(
    rng: random.Random,
    grammar: ToyGrammar,
    prompts: list[str],
    user_marker_prob: float,
    earlier_turns_prob: float = 0.0,
    max_earlier_turns: int = 2,
) -> tuple[list[dict[str, str]], int]:
    """A conversation ending with an assistant reply, and its label: `contains_marker` of that last reply only.

    The replies are `classifier_example`'s, hard negatives (`marker_decoy`) included, so the guard cannot be
    fooled by a fragment any more than the classifier. Some User turns hold markers: the guard judges the Agent.
    With probability `earlier_turns_prob` 1..`max_earlier_turns` earlier exchanges come first, their replies
    marked or not independently of the label: a dialogue is judged on its last Agent message, as Llama Guard
    judges "ONLY THE LAST Agent message" of a multi-turn conversation.
    """
    earlier = rng.randint(1, max_earlier_turns) if rng.random() < earlier_turns_prob else 0
    messages: list[dict[str, str]] = []
    for _ in range(earlier + 1):
        reply, label = classifier_example(rng, grammar, prompts)
        user = grammar.response(rng, marker_prob=0.3) if rng.random() < user_marker_prob else rng.choice(prompts)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages, label
