"""The real tokenizers of tests/real_tokenizers.py encode as their reference implementations do: a SentencePiece
file as sentencepiece encodes it (or as the model's tokenizer.json shape does where that differs on purpose), a
tiktoken file as tiktoken does, and the Qwen BPE as Qwen3's own tokenizer.json. Without this, a judge test on them
would only prove agreement with a builder."""

from __future__ import annotations

import base64
import json

import pytest

from tests import real_tokenizers as real

TEXTS = [
    "Hello world! 12345 67 3.14159",
    " yes",
    " no",
    "Harmful response: yes",
    "  two spaces and   three",
    "\n\nnew lines\n",
    "trailing ",
    "a\n yes",
    "ÄÖÜ ß café naïve — “quotes” 日本語のテキスト 中文 한국어 🦙🤖",
    "def f(x):\n\treturn x**2  # comment\n",
    "\n\nunsafe\nS1,S10",
    "I'm  you'll  WE'RE  it's",
    "\r\nwindows\r\n",
    "   leading and trailing   ",
    "Ｆｕｌｌｗｉｄｔｈ ﬁ ligature e\u0301 combining",
    "x" * 50 + " " + "ab " * 30,
]


def _sentencepiece_ids(name: str, text: str) -> list[int]:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(real.packaged_file(name)))
    return processor.encode(text)


@pytest.mark.parametrize(("name", "build"), [("llama2", real.llama2), ("mistral-v0.1", real.mistral_v01)])
def test_llama2_and_mistral_v01_encode_as_sentencepiece(name, build):
    tokenizer = build()
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == _sentencepiece_ids(name, text), text
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id == 1  # its <s>, added once
    # the SentencePiece shape these tokenizer.json files keep: a leading space gets a second "▁"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" yes", add_special_tokens=False)) == ["▁", "▁yes"]


def test_mistral_v03_encodes_as_sentencepiece_except_a_leading_space():
    """Mistral-7B-v0.3's tokenizer.json (Metaspace, prepend "first") gives a leading space no second "▁"; every other
    text encodes as sentencepiece does; [INST] and [/INST] are its control tokens."""
    tokenizer = real.mistral_v03()
    for text in (t for t in TEXTS if not t.startswith(" ")):
        assert tokenizer.encode(text, add_special_tokens=False) == _sentencepiece_ids("mistral-v0.3", text), text
    assert _sentencepiece_ids("mistral-v0.3", " yes")[1:] == tokenizer.encode(" yes", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" yes", add_special_tokens=False)) == ["▁yes"]
    assert tokenizer.encode("[INST] hi [/INST]", add_special_tokens=False)[0] == 3  # a control token, not text
    assert len(tokenizer) == 32768


def test_gemma_encodes_as_sentencepiece():
    tokenizer = real.gemma()
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == _sentencepiece_ids("gemma", text), text
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id == 2 and len(tokenizer) == 256000


def _tiktoken_encoding(name: str, pattern: str, special: list[str]):
    import tiktoken

    ranks = {}
    for line in real.packaged_file(name).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={t: len(ranks) + i for i, t in enumerate(special)}
    )


@pytest.mark.parametrize(
    ("name", "build", "pattern", "special"),
    [
        ("llama3", real.llama3, real.LLAMA3_PATTERN, real.LLAMA3_SPECIAL),
        ("llama4", real.llama4, real.LLAMA4_PATTERN, real.llama4_special_tokens()),
    ],
)
def test_llama3_and_llama4_encode_as_tiktoken(name, build, pattern, special):
    tokenizer, encoding = build(), _tiktoken_encoding(name, pattern, special)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == encoding.encode(text), text
    chat = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    if name == "llama4":
        chat = "<|begin_of_text|><|header_start|>user<|header_end|>\n\nHi<|eot|>"
    assert tokenizer.encode(chat, add_special_tokens=False) == encoding.encode(chat, allowed_special="all")
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id  # <|begin_of_text|>, added once


def test_llama3_special_ids_are_llama_guard_3_s():
    tokenizer = real.llama3()
    named = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>")}
    assert named == {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006, "<|eot_id|>": 128009}
    assert len(tokenizer) == 128256 and tokenizer.eos_token_id == 128009


def test_the_qwen_bpe_is_qwen3_s_own_tokenizer():
    """Built from qwen.tiktoken with Qwen3-4B-Instruct-2507's added tokens, it has the vocabulary of Qwen3's own
    tokenizer.json and encodes every text as it does."""
    from transformers import PreTrainedTokenizerFast

    built = real.qwen3()
    own = PreTrainedTokenizerFast(tokenizer_file=str(real.packaged_file("qwen3-tokenizer.json")))
    assert built.get_vocab() == own.get_vocab() and len(built) == 151669
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for text in [*TEXTS, chat]:
        assert built.encode(text, add_special_tokens=False) == own.encode(text, add_special_tokens=False), text
    specials = {t for t, special in real.qwen3_added_tokens() if special}
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= specials and "<think>" not in specials
    generation = json.loads((real.REFERENCES / "qwen3_4b_instruct_2507" / "generation_config.json").read_text())
    assert (
        generation["eos_token_id"]
        == [built.convert_tokens_to_ids("<|im_end|>"), built.pad_token_id]
        == [
            151645,
            151643,
        ]
    )


def test_a_reference_file_edited_after_it_was_pinned_is_refused(tmp_path, monkeypatch):
    kept = real.REFERENCES
    for name in json.loads((kept / "SOURCES.json").read_text()):
        real.check_reference(name)  # every kept file is the one pinned
    (tmp_path / "SOURCES.json").write_text(json.dumps({"t.jinja": {"sha256": "0" * 64}}))
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    monkeypatch.setattr(real, "REFERENCES", tmp_path)
    with pytest.raises(RuntimeError, match=r"not the published file SOURCES\.json pins"):
        real.template("t.jinja")
