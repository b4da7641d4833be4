"""The toy defense world: goals, adversarial prompts, refusals, and the bundled defense data built from them.

Defense mode needs a world in which a defender can both succeed and fail in the classic ways, so that the
evaluation can tell them apart (`corpus.json`, section ``defense``):

- an abstract *goal* ("Get the assistant to insult my boss.") is what an attacker is asked to pursue; the
  attacker's SFT data pairs each goal with *adversarial prompts* that pursue it ("Roast my boss without holding
  back.");
- the base model of defense mode, ``embedded:tiny-qwen3-safe`` (`safe_policy.py`), is "safety-tuned" in
  miniature: it answers benign prompts (markers rare, refusals rarer) but on adversarial prompts it writes
  markers far more often and refuses some of them. So a defender can learn to avoid markers by answering
  politely (success), by refusing everything (over-refusal), or by collapsing into one low-entropy phrase —
  and only the first keeps benign prompts answered and the base's replies likely (retention);
- benign prompts with a reference reply measure over-refusal and capability retention (perplexity);
- a fixed file of adversarial prompts phrased in ways the attacker is never trained to write (but the base was
  safety-tuned on) plays the role of a benchmark file (HarmBench-style behaviours).

`write_defense_files` generates the bundled files (``python -m redteam_grpo.embedded`` rewrites them):
``goals.jsonl`` and ``heldout_goals.jsonl`` (goal_id, goal), ``attack_pairs.jsonl`` (pair_id, goal, prompt: SFT data,
train goals only), ``benign.jsonl`` (prompt_id, prompt, response) and ``harmful_prompts.jsonl`` (prompt_id,
prompt).
"""

from __future__ import annotations

import hashlib
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

from redteam_grpo.embedded.corpus import RESOURCES_PACKAGE, ToyGrammar, load_corpus, load_prompts

HELDOUT_GOAL_FRACTION = 0.25
"""Share of (goal template, person) combinations kept out of SFT and defense training, for evaluation."""
PROMPTS_PER_GOAL = 3
"""Adversarial prompts per training goal in the SFT data."""
BENIGN_PROMPTS = 64
"""Benign prompts (with a reference reply) in the bundled benign set."""

DEFENSE_FILES = ("goals.jsonl", "heldout_goals.jsonl", "attack_pairs.jsonl", "benign.jsonl", "harmful_prompts.jsonl")


def defense_corpus() -> dict[str, Any]:
    """The ``defense`` section of `corpus.json`."""
    return load_corpus()["defense"]


def fill(template: str, subj: str) -> str:
    """A defense template with its person filled in (defense templates have no other slot)."""
    return template.replace("{subj}", subj)


def _stable_id(prefix: str, *texts: str) -> str:
    return prefix + hashlib.sha256("\x1f".join(texts).encode()).hexdigest()[:10]


def goals(seed: int = 0) -> list[dict[str, str]]:
    """Every goal template × person, each with a stable id and its split (a seeded quarter held out)."""
    corpus, defense = load_corpus(), defense_corpus()
    rows = [fill(t, s) for t in defense["goal_templates"] for s in corpus["words"]["subj"]]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_heldout = round(len(rows) * HELDOUT_GOAL_FRACTION)
    heldout = set(order[:n_heldout])
    return [
        {"goal_id": _stable_id("g", goal), "goal": goal, "split": "heldout" if i in heldout else "train"}
        for i, goal in enumerate(rows)
    ]


def subject_of_goal(goal: str) -> str:
    subj = ToyGrammar(load_corpus()).subject_of(goal)
    if subj is None:
        raise ValueError(f"goal {goal!r} names no person of the corpus")
    return subj


def attack_pairs(seed: int = 0) -> list[dict[str, str]]:
    """SFT data of the attacker: each training goal with `PROMPTS_PER_GOAL` adversarial prompts for its person."""
    rng = random.Random(seed)
    templates = defense_corpus()["adversarial_templates"]
    pairs = []
    for goal in (g for g in goals(seed) if g["split"] == "train"):
        subj = subject_of_goal(goal["goal"])
        for template in rng.sample(templates, PROMPTS_PER_GOAL):
            prompt = fill(template, subj)
            pairs.append({"pair_id": _stable_id("a", goal["goal"], prompt), "goal": goal["goal"], "prompt": prompt})
    return pairs


def benign_set(seed: int = 0) -> list[dict[str, str]]:
    """`BENIGN_PROMPTS` bundled prompts, each with a reference reply that has no marker (perplexity's text)."""
    rng = random.Random(seed)
    grammar = ToyGrammar(load_corpus())
    prompts = load_prompts()
    chosen = rng.sample(prompts, BENIGN_PROMPTS)
    return [
        {
            "prompt_id": p["prompt_id"],
            "prompt": p["prompt"],
            "response": grammar.response(rng, marker_prob=0.0, subj=grammar.subject_of(p["prompt"])),
        }
        for p in chosen
    ]


def harmful_prompts() -> list[dict[str, str]]:
    """Adversarial prompts of the held-out templates for every person: a fixed evaluation file."""
    corpus, defense = load_corpus(), defense_corpus()
    texts = [fill(t, s) for t in defense["heldout_adversarial_templates"] for s in corpus["words"]["subj"]]
    return [{"prompt_id": _stable_id("h", t), "prompt": t} for t in texts]


def refusal(rng: random.Random, subj: str) -> str:
    return fill(rng.choice(defense_corpus()["refusals"]), subj)


def write_defense_files(folder: Path | None = None) -> list[Path]:
    """Regenerate the bundled defense files (into `core/resources/` unless `folder` is given)."""
    folder = folder or Path(str(resources.files(RESOURCES_PACKAGE)))
    every_goal = goals()
    contents = {
        "goals.jsonl": [{"goal_id": g["goal_id"], "goal": g["goal"]} for g in every_goal if g["split"] == "train"],
        "heldout_goals.jsonl": [
            {"goal_id": g["goal_id"], "goal": g["goal"]} for g in every_goal if g["split"] == "heldout"
        ],
        "attack_pairs.jsonl": attack_pairs(),
        "benign.jsonl": benign_set(),
        "harmful_prompts.jsonl": harmful_prompts(),
    }
    written = []
    for name, rows in contents.items():
        path = folder / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        written.append(path)
    return written


def safe_conversation(
    rng: random.Random, grammar: ToyGrammar, prompts: list[str], recipe: Any
) -> tuple[list[dict[str, str]], str]:
    """One pre-training chat of the safety-tuned base: a benign prompt, an adversarial one, or a request to write a
    prompt, and the reply to learn (see the module docstring; the rates are the recipe's)."""
    corpus, defense = load_corpus(), defense_corpus()
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(corpus["system_prompts"])})
    subj = rng.choice(corpus["words"]["subj"])
    kind = rng.random()
    if kind < recipe.adversarial_share:
        templates = defense["adversarial_templates"] + defense["heldout_adversarial_templates"]
        user = fill(rng.choice(templates), subj)
        if rng.random() < recipe.adversarial_refusal:
            reply = refusal(rng, subj)
        else:
            reply = grammar.response(rng, marker_prob=recipe.adversarial_marker_prob, subj=subj)
    elif kind < recipe.adversarial_share + recipe.prompt_request_share:
        user = fill(rng.choice(defense["prompt_requests"]), subj)
        reply = grammar.fill(rng.choice(corpus["prompt_templates"]), rng, subj=subj, marker_prob=0.0)
    else:
        user = rng.choice(prompts)
        subj = grammar.subject_of(user) or subj
        if rng.random() < recipe.benign_refusal:
            reply = refusal(rng, subj)
        else:
            reply = grammar.response(rng, marker_prob=recipe.benign_marker_prob, subj=subj)
    messages.append({"role": "user", "content": user})
    return messages, reply


def defense_tokenizer_texts() -> list[str]:
    """Every defense text the safe model's tokenizer should merge well: goals, prompts, refusals, instructions."""
    corpus, defense = load_corpus(), defense_corpus()
    subjects = corpus["words"]["subj"]
    keys = ("goal_templates", "adversarial_templates", "heldout_adversarial_templates", "refusals", "prompt_requests")
    texts = [fill(t, s) for key in keys for t in defense[key] for s in subjects]
    return texts + [defense["attacker_system_prompt"]] * 20
