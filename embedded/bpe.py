"""Byte-level BPE tokenizers trained on the toy corpus, in which every marker word is a single token.

Every marker word is a single token in every tokenizer (checked at build time). If a marker were split into
pieces, the classifier would learn the first piece as the toxic feature and the policy would learn to emit that
piece alone. The classifier's tokenizer is trained on plain grammar text only, so an inflected marker keeps the
marker's token ("idiots" = "Ġidiot" + "s").

The model modules wrap these in `PreTrainedTokenizerFast` with their own special tokens and chat templates.
"""

from __future__ import annotations

import random
from typing import Any

from redteam_grpo.embedded.corpus import ToyGrammar, load_corpus, load_prompts, marker_words


def check_single_tokens(tok: Any) -> None:
    """Each marker is one token at a word start ("Ġstupid") and glued to punctuation or a line start."""
    for word in marker_words():
        for piece in (word, "\u0120" + word):
            tokens = [t.value for t in tok.model.tokenize(piece)]
            if len(tokens) != 1:
                raise RuntimeError(f"marker {word!r} is not a single token: {tokens}")


def word_list_texts() -> list[str]:
    """Every corpus word, markers included, often enough to become a whole token with and without "Ġ"."""
    corpus = load_corpus()
    words = [w for ws in corpus["words"].values() for w in ws] + list(marker_words())
    return [" ".join(words)] * 20 + ["\n".join(words)] * 20


def tokenizer_training_texts(rng: random.Random, marker_prob: float) -> list[str]:
    """The bundled prompts, system prompts, role names, 4000 grammar replies and the word lists."""
    corpus = load_corpus()
    grammar = ToyGrammar(corpus)
    texts = [p["prompt"] for p in load_prompts()] + corpus["system_prompts"] + ["system user assistant"] * 10
    texts += [grammar.response(rng, marker_prob=marker_prob) for _ in range(4000)]
    return texts + word_list_texts()


def chat_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]) -> Any:
    """A cased byte-level BPE trained on `texts` (the chat models' tokenizers), every marker one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    check_single_tokens(tok)
    return tok


def classifier_bpe(texts: list[str], vocab_size: int) -> Any:
    """A lowercase byte-level BPE with BERT's special tokens and ``[CLS] text [SEP]``; every marker one token.

    Not WordPiece: the `tokenizers` WordPiece trainer numbers its "##" pieces in hash order, so two processes
    train different vocabularies from the same text (measured). Byte-level BPE over the full byte alphabet is
    reproducible, and its "Ġ" word-start marker keeps "stupid d" (toxic) apart from "stupidd" (not).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    check_single_tokens(tok)
    return tok
