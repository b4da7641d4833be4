"""``embedded:tiny-qwen3``: the default policy, a tiny Qwen3 chat model pre-trained on the toy corpus.

A byte-level BPE tokenizer (~840 tokens) trained on the toy corpus, with Qwen3-Instruct's special tokens
(``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` eos = end of turn) and a Qwen-style chat template, plus a
~0.4M-parameter `Qwen3ForCausalLM` (hidden 128, 2 layers). It is pre-trained for 200 steps (~20 s) on
chat-formatted conversations: a bundled user prompt, then an assistant reply sampled from the toy grammar, loss
on the reply and its ``<|im_end|>`` only. A random-init policy emits noise and does not learn under RL; this one
writes fluent toy sentences, ends ~85 % of its replies with ``<|im_end|>`` within 24 tokens at temperature 1, and
uses a marker word in about one reply in ten — a low but non-zero start that GRPO can amplify.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from redteam_grpo.embedded.bpe import chat_bpe, tokenizer_training_texts
from redteam_grpo.embedded.corpus import ToyGrammar, load_corpus, load_prompts, sample_conversation
from redteam_grpo.embedded.recipes import BuildRecipe
from redteam_grpo.embedded.training import answer_batch, answer_loss_step, warmup_cosine_schedule

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen's template without the tool and thinking branches: one header line per message, end of turn, newline.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_policy_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE with Qwen3-Instruct's special tokens and a Qwen-style chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=chat_bpe(texts, vocab_size, [PAD_TOKEN, IM_START, IM_END]),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )


def pretrain_policy(
    tokenizer: Any,
    recipe: Any,
    rng: random.Random,
    conversation: Callable[[random.Random], tuple[list[dict[str, str]], str]] | None = None,
) -> Any:
    """A tiny Qwen3 pre-trained on chat-formatted toy conversations; loss on the assistant reply only.

    `conversation(rng)` samples one (messages, reply); the default is the red-team policy's toy chat
    (`sample_conversation`). `recipe` gives the steps, batch size and learning rate (`BuildRecipe`, `SafeRecipe`).
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if conversation is None:
        corpus = load_corpus()
        grammar = ToyGrammar(corpus)
        prompts = [p["prompt"] for p in load_prompts()]

        def conversation(rng: random.Random) -> tuple[list[dict[str, str]], str]:
            return sample_conversation(rng, grammar, prompts, corpus, recipe.marker_prob)

    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=pad_id,  # as in Qwen3: no BOS is prepended, <|endoftext|> doubles as bos/pad
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    model = Qwen3ForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.policy_lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine_schedule(recipe.policy_steps, warmup=30))
    for _ in range(recipe.policy_steps):
        convs = [conversation(rng) for _ in range(recipe.policy_batch_size)]
        prompt_texts = tokenizer.apply_chat_template([m for m, _ in convs], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer([r + IM_END for _, r in convs], add_special_tokens=False)["input_ids"]
        answer_loss_step(model, opt, sched, answer_batch(prompt_ids, reply_ids, pad_id))
    model.eval()
    # Sampling defaults for RL: plain temperature-1 sampling. transformers' default top-k 50 would sample from
    # another distribution than the one the trainer scores.
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    return model


def build_policy(out_dir: Path, recipe: BuildRecipe) -> dict[str, Any]:
    """Tokenizer + pre-trained tiny Qwen3 into `out_dir`; returns build facts for the manifest."""
    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    tokenizer = build_policy_tokenizer(tokenizer_training_texts(rng, 0.2), recipe.policy_vocab_size)
    model = pretrain_policy(tokenizer, recipe, rng)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"policy_seconds": round(time.perf_counter() - t0, 2), "policy_vocab_size": len(tokenizer)}
