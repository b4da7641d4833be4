"""``embedded:tiny-toxicity``: the default harm scorer, a tiny BERT classifier of the toy corpus's marker rule.

A lowercase byte-level BPE tokenizer and a tiny `BertForSequenceClassification` (hidden 64, 2 layers) trained for
~10 s on texts from the toy grammar, hard negatives included (`corpus.classifier_example`). Its ground truth is
`corpus.contains_marker`: a text is toxic exactly when one of its words starts with a marker word.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from redteam_grpo.embedded.bpe import classifier_bpe, tokenizer_training_texts
from redteam_grpo.embedded.corpus import ToyGrammar, classifier_example, load_corpus, load_prompts
from redteam_grpo.embedded.recipes import BuildRecipe
from redteam_grpo.embedded.training import warmup_cosine_schedule

TOXIC_LABEL = "toxic"
ID2LABEL = {0: "non-toxic", 1: TOXIC_LABEL}


def build_classifier_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """`classifier_bpe` with BERT's special tokens named, right padding and 128 positions."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=classifier_bpe(texts, vocab_size),
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        padding_side="right",
        model_max_length=128,
    )


def train_classifier(tokenizer: Any, recipe: BuildRecipe, rng: random.Random) -> Any:
    """A tiny BERT classifier on freshly generated labelled texts (a new batch every step)."""
    from transformers import BertConfig, BertForSequenceClassification

    grammar = ToyGrammar(load_corpus())
    prompts = [p["prompt"] for p in load_prompts()]
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,  # every batch is fresh data: nothing to over-fit, and dropout costs ~15 %
        attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
        id2label=ID2LABEL,
        label2id={v: k for k, v in ID2LABEL.items()},
    )
    model = BertForSequenceClassification(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.classifier_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine_schedule(recipe.classifier_steps, warmup=30))
    for _ in range(recipe.classifier_steps):
        batch = [classifier_example(rng, grammar, prompts) for _ in range(recipe.classifier_batch_size)]
        enc = tokenizer([t for t, _ in batch], padding=True, truncation=True, max_length=64, return_tensors="pt")
        logits = model(**enc).logits  # [B, 2]
        loss = F.cross_entropy(logits, torch.tensor([y for _, y in batch]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return model


@torch.no_grad()
def toxic_probability(model: Any, tokenizer: Any, texts: list[str]) -> list[float]:
    """P(toxic) per text under the classifier."""
    enc = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    probs = model(**enc).logits.softmax(-1)[:, model.config.label2id[TOXIC_LABEL]]
    return probs.tolist()


def build_classifier(out_dir: Path, recipe: BuildRecipe) -> dict[str, Any]:
    """Tokenizer + trained tiny BERT classifier into `out_dir`; returns build facts for the manifest."""
    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed + 1)
    rng = random.Random(recipe.seed + 1)
    grammar = ToyGrammar(load_corpus())
    prompts = [p["prompt"] for p in load_prompts()]
    # The tokenizer sees plain grammar text only, so an inflected marker ("idiots") keeps the marker's token.
    tokenizer = build_classifier_tokenizer(tokenizer_training_texts(rng, 0.2), recipe.classifier_vocab_size)
    model = train_classifier(tokenizer, recipe, rng)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    heldout_rng = random.Random(recipe.seed + 2)
    heldout = [classifier_example(heldout_rng, grammar, prompts) for _ in range(1000)]
    probs = toxic_probability(model, tokenizer, [t for t, _ in heldout])
    accuracy = sum((p > 0.5) == bool(y) for p, (_, y) in zip(probs, heldout, strict=True)) / len(heldout)
    return {"classifier_seconds": round(time.perf_counter() - t0, 2), "classifier_heldout_accuracy": accuracy}
