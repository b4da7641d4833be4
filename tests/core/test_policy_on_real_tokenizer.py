"""The shipped configs' policy, Qwen/Qwen3-4B-Instruct-2507, on its real tokenizer and published chat template
(tests/real_tokenizers.py): the prompt ids every stage uses are the template's, rendered independently; the stop ids
are the model's; and a hybrid-thinking Qwen3 template is rendered in the mode its model card describes."""

from __future__ import annotations

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from redteam_grpo.core.config import ModelConfig
from redteam_grpo.core.models.chat import end_of_turn_ids, format_prompt_ids, turn_closing_id
from redteam_grpo.core.models.policy import PolicyError, load_tokenizer
from tests import real_tokenizers as real

SYSTEM = "You are a helpful assistant."


def _jinja(template: str, **context) -> str:
    """A chat template rendered by jinja2 alone, as Hugging Face documents chat templates are rendered (sandboxed,
    trim_blocks and lstrip_blocks), without transformers."""

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template).render(**context)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_prompt_ids_are_the_published_template_s_rendered_by_jinja_alone_and_as_chatml_documents_it():
    tokenizer = real.qwen3()
    prompt = "How do I pick a lock?"
    ids = format_prompt_ids(tokenizer, prompt, SYSTEM)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    independent = _jinja(tokenizer.chat_template, messages=messages, add_generation_prompt=True)
    chatml = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert independent == chatml
    assert ids == _ids(tokenizer, chatml)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 151644  # no BOS: Qwen has none
    assert ids[-3:] == [151644, *_ids(tokenizer, "assistant\n")]
    without_system = format_prompt_ids(tokenizer, prompt, None)
    assert without_system == _ids(tokenizer, f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def test_the_stop_ids_are_the_model_s_own():
    """Qwen3-4B-Instruct-2507 ends a turn with <|im_end|> (its eos) and its generation config also stops on
    <|endoftext|>: both stop sampling, and SFT closes a turn the way the template does, with <|im_end|>."""
    import json

    tokenizer = real.qwen3()
    generation = json.loads((real.REFERENCES / "qwen3_4b_instruct_2507" / "generation_config.json").read_text())
    assert end_of_turn_ids(tokenizer) == end_of_turn_ids(tokenizer, generation["eos_token_id"]) == [151643, 151645]
    assert turn_closing_id(tokenizer, [151643, 151645]) == 151645


@pytest.fixture
def hybrid_folder(tmp_path):
    """Qwen3's tokenizer with the hybrid-thinking Qwen3 template (Qwen/Qwen3-4B), saved as a model folder is."""
    tokenizer = real.with_template(real.qwen3(), "qwen3_4b.jinja")
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_a_thinking_template_renders_each_mode_as_its_model_card_says(hybrid_folder, tmp_path):
    """enable_thinking=False: the template opens the answer with an empty think block, which stops the model from
    thinking; unset: the template's default (the model may think)."""
    prompt = "Hi"
    off = load_tokenizer(ModelConfig(policy=str(hybrid_folder), enable_thinking=False))
    default = load_tokenizer(ModelConfig(policy=str(hybrid_folder)))
    on = load_tokenizer(ModelConfig(policy=str(hybrid_folder), enable_thinking=True))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    template = real.template("qwen3_4b.jinja")
    assert format_prompt_ids(off, prompt, SYSTEM) == _ids(
        off, _jinja(template, messages=messages, add_generation_prompt=True, enable_thinking=False)
    )
    assert off.decode(format_prompt_ids(off, prompt, SYSTEM)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.decode(format_prompt_ids(default, prompt, SYSTEM)).endswith("<|im_start|>assistant\n")
    assert format_prompt_ids(on, prompt, SYSTEM) == format_prompt_ids(default, prompt, SYSTEM)
    # a template without a thinking mode: the setting would do nothing, so it is refused
    real.qwen3().save_pretrained(tmp_path / "instruct")
    with pytest.raises(PolicyError, match="does not read enable_thinking"):
        load_tokenizer(ModelConfig(policy=str(tmp_path / "instruct"), enable_thinking=False))
