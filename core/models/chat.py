"""The one chat-formatting function of the project.

Sampling, SFT, inference and evaluation all turn a prompt into token ids here, so the ids the sampler saw are the ids
every later stage uses (bug classes `sft-prompt-format-drift`, `trained-ids-differ-from-sampled`). Nothing downstream
re-tokenizes text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# End-of-turn tokens of common chat templates. A chat model ends its turn on one of these, often not on
# `eos_token_id` (Qwen3: <|im_end|>; Llama 3: <|eot_id|>; Gemma: <end_of_turn>).
KNOWN_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")
# Tokens that open a chat turn; a response that contains one has crossed a turn boundary.
KNOWN_TURN_HEADER_TOKENS = ("<|im_start|>", "<|start_header_id|>", "<|end_header_id|>", "<start_of_turn>")


def build_messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return messages


def format_prompt_ids(tokenizer: Any, prompt: str, system_prompt: str | None) -> list[int]:
    """Token ids of `prompt` as the policy sees it: chat template with the assistant turn opened."""
    encoded = tokenizer.apply_chat_template(
        build_messages(prompt, system_prompt), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def format_sft_ids(
    tokenizer: Any, prompt: str, response: str, system_prompt: str | None, end_of_turn_id: int
) -> tuple[list[int], int]:
    """(ids, prompt_length) of a supervised example; ids start with exactly `format_prompt_ids(...)`.

    The response is tokenized on its own and appended, then the turn is closed with `end_of_turn_id`, so the
    prompt part cannot differ from what RL samples from (bug class `sft-prompt-format-drift`).
    """
    prompt_ids = format_prompt_ids(tokenizer, prompt, system_prompt)
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return prompt_ids + list(response_ids) + [end_of_turn_id], len(prompt_ids)


def turn_closing_id(tokenizer: Any, end_of_turn: Sequence[int]) -> int:
    """The end-of-turn id the chat template itself closes an assistant turn with (Qwen: <|im_end|>, Llama 3:
    <|eot_id|>). SFT targets end with it, so a fine-tuned model stops the way the template says; the smallest
    end-of-turn id may be another (Qwen's <|endoftext|>) that the model never learned to end a turn with."""
    marker = "\u2063closing\u2063"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    tail = rendered[rendered.rindex(marker) + len(marker) :]
    for token_id in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token_id in end_of_turn:
            return int(token_id)
    if tokenizer.eos_token_id in end_of_turn:
        return int(tokenizer.eos_token_id)
    raise ValueError("the chat template closes an assistant turn with no end-of-turn token")


def end_of_turn_ids(tokenizer: Any, generation_eos: int | Sequence[int] | None = None) -> list[int]:
    """Every id that ends an assistant turn: eos, the generation config's eos list, known end-of-turn tokens."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if generation_eos is not None:
        ids.update(int(i) for i in ([generation_eos] if isinstance(generation_eos, int) else generation_eos))
    vocab = tokenizer.get_vocab()
    specials = set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {}))
    for token in KNOWN_END_OF_TURN_TOKENS:
        if token in vocab and token in specials:
            ids.add(int(vocab[token]))
    if not ids:
        raise ValueError("the tokenizer defines no end-of-turn token: set eos_token or use a chat model")
    return sorted(ids)


def turn_header_ids(tokenizer: Any) -> list[int]:
    """Ids of tokens that open a chat turn; they must never appear inside a response."""
    vocab = tokenizer.get_vocab()
    return sorted(int(vocab[t]) for t in KNOWN_TURN_HEADER_TOKENS if t in vocab)
