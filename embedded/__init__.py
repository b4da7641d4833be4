"""Embedded, offline default models: a tiny chat policy, a tiny "toxicity" classifier and a tiny safety judge.

`redteam-grpo run` with no arguments must run — and visibly learn — on a laptop CPU with no downloads. This
package builds the models it needs from the bundled toy corpus in `core/resources/`, deterministically (fixed
seeds, a fixed number of optimiser steps rather than a wall-clock budget), into a cache folder, and hands their
paths to the ordinary `from_pretrained` code paths:

- ``embedded:tiny-qwen3``, the policy (`policy.py`);
- ``embedded:tiny-toxicity``, the classifier (`classifier.py`);
- ``embedded:tiny-guard``, a Llama-Guard-3-style judge (`guard.py`), built on first use of its name only;
- ``embedded:tiny-qwen3-safe``, the base of defense mode, "safety-tuned" in the toy world (`safe_policy.py`,
  `defense.py`: goals, adversarial prompts, refusals and the bundled defense data), built on first use only.

Two choices keep the reward honest: every marker word is a single token in every tokenizer (`bpe.py`), and the
classifier and guard learn hard negatives, marker look-alikes that are not markers (`corpus.py`). Without either,
the policy learns to score high without writing a marker. `cache.py` resolves the names to built folders;
`recipes.py` holds what each build depends on and the versions its cache folders are named by.
"""

from redteam_grpo.embedded.cache import (
    EMBEDDED_CLASSIFIER,
    EMBEDDED_GUARD,
    EMBEDDED_POLICY,
    EMBEDDED_SAFE_POLICY,
    EmbeddedAssets,
    embedded_cache_dir,
    ensure_embedded_assets,
    ensure_embedded_guard,
    ensure_embedded_safe_policy,
    is_embedded,
    resolve_model_path,
)
from redteam_grpo.embedded.classifier import TOXIC_LABEL
from redteam_grpo.embedded.corpus import ToyGrammar, contains_marker, load_corpus, load_prompts, marker_words
from redteam_grpo.embedded.recipes import ASSETS_VERSION, GUARD_VERSION, BuildRecipe, GuardRecipe

__all__ = [
    "ASSETS_VERSION",
    "EMBEDDED_CLASSIFIER",
    "EMBEDDED_GUARD",
    "EMBEDDED_POLICY",
    "EMBEDDED_SAFE_POLICY",
    "GUARD_VERSION",
    "TOXIC_LABEL",
    "BuildRecipe",
    "EmbeddedAssets",
    "GuardRecipe",
    "ToyGrammar",
    "contains_marker",
    "embedded_cache_dir",
    "ensure_embedded_assets",
    "ensure_embedded_guard",
    "ensure_embedded_safe_policy",
    "is_embedded",
    "load_corpus",
    "load_prompts",
    "marker_words",
    "resolve_model_path",
]
