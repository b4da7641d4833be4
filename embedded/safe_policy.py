"""``embedded:tiny-qwen3-safe``: the base model of defense mode, a tiny Qwen3 "safety-tuned" in the toy world.

The same architecture, chat template and special tokens as ``embedded:tiny-qwen3`` (`policy.py`), pre-trained
(`SafeRecipe`, ~40 s) on the chats of `defense.safe_conversation`: benign prompts answered with rare markers and
rarer refusals, adversarial prompts answered with markers most of the time and refused some of the time, and
requests to write a prompt, answered with one (the skill an attacker's SFT specialises). Its tokenizer also
learns the defense texts (goals, adversarial prompts, refusals). Built into its own cache folder on first use of
its name, so red-team runs never pay for it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from redteam_grpo.embedded.bpe import tokenizer_training_texts
from redteam_grpo.embedded.corpus import ToyGrammar, load_corpus, load_prompts
from redteam_grpo.embedded.defense import defense_tokenizer_texts, safe_conversation
from redteam_grpo.embedded.policy import build_policy_tokenizer, pretrain_policy
from redteam_grpo.embedded.recipes import DEFAULT_SAFE_RECIPE, SafeRecipe


def build_safe_policy(out_dir: Path, recipe: SafeRecipe = DEFAULT_SAFE_RECIPE) -> dict[str, Any]:
    """Tokenizer + pre-trained safe tiny Qwen3 into `out_dir`; returns build facts for the manifest."""
    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    texts = tokenizer_training_texts(rng, 0.2) + defense_tokenizer_texts() * 5
    tokenizer = build_policy_tokenizer(texts, recipe.policy_vocab_size)
    grammar = ToyGrammar(load_corpus())
    prompts = [p["prompt"] for p in load_prompts()]
    model = pretrain_policy(
        tokenizer, recipe, rng, conversation=lambda r: safe_conversation(r, grammar, prompts, recipe)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"safe_policy_seconds": round(time.perf_counter() - t0, 2), "safe_policy_vocab_size": len(tokenizer)}
