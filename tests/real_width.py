"""A random model of Qwen3-4B's width and vocabulary, two of its layers, in bfloat16, with Qwen3-4B-Instruct-2507's
real tokenizer (tests/real_tokenizers.py): what the real-width run (tests/e2e/test_real_width.py) and the first-update
check's margins (tests/core/test_first_update_check.py) run on. The whole model at 36 layers: bench/real_size.py."""

from __future__ import annotations

from pathlib import Path

import torch

# Qwen/Qwen3-4B's config.json but for its depth (36 layers)
QWEN3_4B_WIDTH = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}


def save_real_width_model(folder: Path) -> Path:
    """The model and its tokenizer into `folder`. The tokenizer's rows of the tied head ~N(0, 25), so its logits are
    spread as a real model's; the 267 padding rows past the tokenizer's 151,669 ids 0 (they have no text)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from tests import real_tokenizers as real

    tokenizer = real.qwen3()
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_4B_WIDTH, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)  # no float32 copy
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight  # tied: the LM head's rows too
        embeddings[len(tokenizer) :] = 0  # their logits 0 ...
        embeddings[: len(tokenizer)] *= 5  # ... the tokenizer's ~N(0, 25): those are drawn
    model.generation_config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
