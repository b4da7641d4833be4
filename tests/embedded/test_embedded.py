"""The embedded offline assets: tokenizers, chat template, build determinism and atomicity, classifier quality.

Each quality test runs on the shipped default build (what every machine uses: embedded/shipped.py) and on the
default recipe trained here, once per session (~35 s on 2 CPU cores), so the recipe keeps making models of that
quality on whatever CPU runs the tests; the build-mechanics tests use a 2-step recipe (~1.5 s a build) so that
building twice stays cheap.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BatchEncoding,
)

from redteam_grpo.embedded import (
    ASSETS_VERSION,
    EMBEDDED_CLASSIFIER,
    EMBEDDED_POLICY,
    TOXIC_LABEL,
    BuildRecipe,
    EmbeddedAssets,
    cache,
    contains_marker,
    corpus,
    embedded_cache_dir,
    ensure_embedded_assets,
    is_embedded,
    marker_words,
    resolve_model_path,
)

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

SHORT = BuildRecipe(policy_steps=2, classifier_steps=2)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embedded-cache")


@pytest.fixture(scope="session")
def cached_assets(cache_dir: Path) -> EmbeddedAssets:
    """The default build as a first use puts it into a cache: the shipped one."""
    return ensure_embedded_assets(cache_dir)


@pytest.fixture(scope="session")
def trained_here(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedAssets:
    """The default recipe trained on this machine (its weights depend on the CPU's kernels; its quality must not)."""
    return cache.train_embedded_assets(tmp_path_factory.mktemp("trained-here"))


@pytest.fixture(scope="session", params=["shipped", "trained-here"])
def assets(request: pytest.FixtureRequest) -> EmbeddedAssets:
    return request.getfixturevalue("cached_assets" if request.param == "shipped" else "trained_here")


@pytest.fixture(scope="session")
def policy_tok(assets: EmbeddedAssets):
    return AutoTokenizer.from_pretrained(assets.policy_dir)


@pytest.fixture(scope="session")
def classifier(assets: EmbeddedAssets):
    tok = AutoTokenizer.from_pretrained(assets.classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(assets.classifier_dir).eval()
    return tok, model


def _p_toxic(classifier, texts: list[str]) -> torch.Tensor:
    tok, model = classifier
    with torch.no_grad():
        logits = model(**tok(texts, padding=True, truncation=True, return_tensors="pt")).logits
    return logits.softmax(-1)[:, model.config.label2id[TOXIC_LABEL]]  # [N]


# ------------------------------------------------------------------------------------------ policy tokenizer


def test_policy_special_tokens(policy_tok, assets: EmbeddedAssets) -> None:
    assert policy_tok.eos_token == "<|im_end|>"
    assert policy_tok.pad_token == "<|endoftext|>"
    assert policy_tok.eos_token_id != policy_tok.pad_token_id
    assert policy_tok.padding_side == "left"
    assert policy_tok.convert_tokens_to_ids("<|im_start|>") not in (None, policy_tok.unk_token_id)
    assert 500 <= len(policy_tok) <= 2048


def test_markers_are_single_tokens_in_both_tokenizers(policy_tok, classifier) -> None:
    clf_tok, _ = classifier
    for m in marker_words():
        assert len(policy_tok.encode(m, add_special_tokens=False)) == 1, m  # at a line start
        assert len(policy_tok.encode(" " + m, add_special_tokens=False)) == 1, m  # mid-sentence
        assert len(clf_tok.encode(m, add_special_tokens=False)) == 1, m
        assert len(clf_tok.encode(m.upper(), add_special_tokens=False)) == 1, m  # lowercased first
    # A fragment is not the marker's token: "stup" must not encode to what "stupid" does.
    assert policy_tok.encode(" stup", add_special_tokens=False) != policy_tok.encode(
        " stupid", add_special_tokens=False
    )


def test_chat_template_renders_qwen_format(policy_tok) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Describe my boss."},
    ]
    text = policy_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nDescribe my boss.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # transformers 5: tokenize=True returns a BatchEncoding by default; return_dict=False gives the ids.
    enc = policy_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert isinstance(enc, BatchEncoding)
    ids = policy_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == enc["input_ids"] == policy_tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == policy_tok.convert_tokens_to_ids("<|im_start|>")
    assert policy_tok.decode(ids) == text
    no_prompt = policy_tok.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


# ------------------------------------------------------------------------------------------ policy model


def test_policy_config_and_generation_config(assets: EmbeddedAssets, policy_tok) -> None:
    model = AutoModelForCausalLM.from_pretrained(assets.policy_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    cfg = model.config
    assert cfg.vocab_size == len(policy_tok)
    assert cfg.eos_token_id == policy_tok.eos_token_id and cfg.pad_token_id == policy_tok.pad_token_id
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_theta"] == 10000.0
    gen = model.generation_config
    assert gen.eos_token_id == policy_tok.eos_token_id and gen.pad_token_id == policy_tok.pad_token_id
    assert gen.do_sample and gen.top_k == 0  # bug class hidden-top-k (docs/bug-classes.md)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_policy_samples_fluent_replies_with_some_markers(assets: EmbeddedAssets, policy_tok) -> None:
    """At T=1 (no top-k/top-p), 24 new tokens: mostly finished turns, some cut off, a low marker rate."""
    model = AutoModelForCausalLM.from_pretrained(assets.policy_dir).eval()
    prompts = [p["prompt"] for p in corpus.load_prompts()][:128]
    enc = policy_tok.apply_chat_template(
        [[{"role": "user", "content": p}] for p in prompts],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
    )
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and not 30x slower when the CPU is shared
    try:
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0
            )  # [N, P + ≤24]
    finally:
        torch.set_num_threads(threads)
    completions = out[:, enc["input_ids"].shape[1] :]
    eos = policy_tok.eos_token_id
    ended = (completions == eos).any(dim=1)  # [N]
    texts = policy_tok.batch_decode(completions, skip_special_tokens=True)
    marker_rate = sum(contains_marker(t) for t in texts) / len(texts)
    assert 0.6 <= ended.float().mean() < 1.0  # most end with <|im_end|>, a minority hits the limit
    assert 0.03 <= marker_rate <= 0.25
    words = {w for ws in corpus.load_corpus()["words"].values() for w in ws}
    first_words = [t.split()[0].strip(",.").lower() for t in texts if t.split()]
    assert sum(w in words | {"your", "i", "honestly"} for w in first_words) / len(texts) > 0.9


# ------------------------------------------------------------------------------------------ classifier


def test_classifier_labels(classifier) -> None:
    _, model = classifier
    assert model.config.id2label == {0: "non-toxic", 1: "toxic"}
    assert model.config.label2id == {"non-toxic": 0, "toxic": 1}


def test_classifier_scores_markers_high_and_fragments_low(classifier) -> None:
    rng = random.Random(7)
    grammar = corpus.ToyGrammar(corpus.load_corpus())
    neutral = [grammar.response(rng, marker_prob=0.0) for _ in range(100)]
    toxic = [t for t in (grammar.response(rng, marker_prob=0.3) for _ in range(200)) if contains_marker(t)][:100]
    bare = list(marker_words()) + [f"{m.capitalize()}!" for m in marker_words()]
    fragments = ["stup", "idi", "worthl", "pathet", "disgust", "useles", "los", "stu pid", "idoit", "xhate"]
    decoys = fragments + [f"Your boss is {f}." for f in fragments]
    decoys += [corpus.insert_words(rng, n, [corpus.marker_decoy(rng, rng.choice(marker_words()))]) for n in neutral]
    assert not any(contains_marker(t) for t in neutral + decoys)
    assert _p_toxic(classifier, toxic).mean() > 0.8
    assert _p_toxic(classifier, bare).mean() > 0.8
    assert _p_toxic(classifier, neutral).mean() < 0.2
    assert _p_toxic(classifier, decoys).mean() < 0.3
    # Nearly every hand-picked fragment scores low. Which one, if any, a classifier trained on this machine gets wrong
    # depends on the CPU's kernels (an AVX-512 Xeon's scored the misspelling "idoit" 0.87; an AVX2 EPYC's none).
    assert (_p_toxic(classifier, fragments) < 0.5).sum() >= len(fragments) - 1


def test_classifier_heldout_accuracy(classifier) -> None:
    rng = random.Random(11)
    grammar = corpus.ToyGrammar(corpus.load_corpus())
    prompts = [p["prompt"] for p in corpus.load_prompts()]
    examples = [corpus.classifier_example(rng, grammar, prompts) for _ in range(500)]
    probs = _p_toxic(classifier, [t for t, _ in examples])
    labels = torch.tensor([y for _, y in examples], dtype=torch.bool)
    assert ((probs > 0.5) == labels).float().mean() > 0.95


# ------------------------------------------------------------------------------------------ names and paths


def test_is_embedded() -> None:
    assert is_embedded(EMBEDDED_POLICY) and is_embedded(EMBEDDED_CLASSIFIER) and is_embedded("embedded:xyz")
    assert not is_embedded("Qwen/Qwen3-4B-Instruct-2507")


def test_resolve_model_path(cache_dir: Path, cached_assets: EmbeddedAssets) -> None:
    assets = cached_assets
    assert resolve_model_path(EMBEDDED_POLICY, cache_dir) == str(assets.policy_dir)
    assert resolve_model_path(EMBEDDED_CLASSIFIER, cache_dir) == str(assets.classifier_dir)
    assert resolve_model_path("Qwen/Qwen3-4B-Instruct-2507", cache_dir) == "Qwen/Qwen3-4B-Instruct-2507"
    assert resolve_model_path("/some/local/dir") == "/some/local/dir"
    with pytest.raises(ValueError, match="embedded:tiny-qwen3") as err:
        resolve_model_path("embedded:xyz", cache_dir)
    assert "embedded:xyz" in str(err.value) and EMBEDDED_CLASSIFIER in str(err.value)


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REDTEAM_GRPO_CACHE", str(tmp_path / "c"))
    assert embedded_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("REDTEAM_GRPO_CACHE")
    assert embedded_cache_dir() == Path.home() / ".cache" / "redteam-grpo"


def test_default_build_is_versioned_and_reused(cache_dir: Path, cached_assets: EmbeddedAssets) -> None:
    assets = cached_assets
    assert assets.policy_dir.parent.name == f"embedded-{ASSETS_VERSION}"
    assert (assets.policy_dir.parent / "manifest.json").is_file()
    assert ensure_embedded_assets(cache_dir) == assets  # no rebuild: returns at once
    assert not list(cache_dir.glob(".*tmp-*"))


def test_the_recipe_trained_here_makes_the_shipped_tokenizers_and_configs(
    cached_assets: EmbeddedAssets, trained_here: EmbeddedAssets
) -> None:
    """Only the weights may differ from the shipped build (they depend on the CPU's kernels): the tokenizers,
    chat template and model configurations are the same bytes."""
    for shipped_dir, here_dir in [
        (cached_assets.policy_dir, trained_here.policy_dir),
        (cached_assets.classifier_dir, trained_here.classifier_dir),
    ]:
        names = sorted(p.name for p in shipped_dir.iterdir())
        assert names == sorted(p.name for p in here_dir.iterdir())
        for name in names:
            if name != "model.safetensors":
                assert (shipped_dir / name).read_bytes() == (here_dir / name).read_bytes(), name
        shipped_tensors, here_tensors = _tensors(shipped_dir), _tensors(here_dir)
        assert {k: v.shape for k, v in shipped_tensors.items()} == {k: v.shape for k, v in here_tensors.items()}


# ------------------------------------------------------------------------------------------ build mechanics


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


def test_build_is_deterministic_and_leaves_global_state(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    rng_state = torch.random.get_rng_state()
    a = ensure_embedded_assets(tmp_path / "a", recipe=SHORT)
    b = ensure_embedded_assets(tmp_path / "b", recipe=SHORT)
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    for da, db in [(a.policy_dir, b.policy_dir), (a.classifier_dir, b.classifier_dir)]:
        ta, tb = _tensors(da), _tensors(db)
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta)
        assert (da / "tokenizer.json").read_bytes() == (db / "tokenizer.json").read_bytes()
    assert a.policy_dir.parent.name != f"embedded-{ASSETS_VERSION}"  # a non-default recipe: own folder


def test_failed_build_leaves_nothing_and_next_call_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(out_dir: Path, recipe: BuildRecipe) -> dict:
        raise RuntimeError("simulated crash while training the classifier")

    monkeypatch.setattr(cache, "build_classifier", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_embedded_assets(tmp_path, recipe=SHORT)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.undo()
    assets = ensure_embedded_assets(tmp_path, recipe=SHORT)
    assert (assets.policy_dir / "model.safetensors").is_file()
    assert (assets.classifier_dir / "model.safetensors").is_file()
    AutoTokenizer.from_pretrained(assets.classifier_dir)


def test_stale_temporary_folder_is_cleaned_and_concurrent_callers_build_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def fake_build(out_dir: Path, recipe: BuildRecipe) -> EmbeddedAssets:
        calls.append(out_dir)
        threading.Event().wait(0.2)
        (out_dir / "manifest.json").write_text("{}")
        return EmbeddedAssets(out_dir / "policy", out_dir / "classifier")

    monkeypatch.setattr(cache, "build_embedded_assets", fake_build)
    stale = tmp_path / f".embedded-{ASSETS_VERSION}.tmp-999-dead"  # left by a killed build
    stale.mkdir()
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_embedded_assets(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 3
    assert not stale.exists()
    assert (tmp_path / f"embedded-{ASSETS_VERSION}" / "manifest.json").is_file()


# ------------------------------------------------------------------------------------------ bundled data


def test_bundled_prompts_match_their_generator() -> None:
    prompts = corpus.load_prompts()
    assert prompts == corpus.generate_prompts()
    assert 150 <= len(prompts) <= 300
    assert len({p["prompt_id"] for p in prompts}) == len(prompts)
    assert not any(contains_marker(p["prompt"]) for p in prompts)


def test_contains_marker_and_decoys() -> None:
    assert contains_marker("Your boss is STUPID.") and contains_marker("idiots") and contains_marker("x.hate")
    assert not any(contains_marker(t) for t in ["stup", "stu pid", "xstupid", "Your boss is kind.", ""])
    rng = random.Random(0)
    for _ in range(2000):
        assert not contains_marker(corpus.marker_decoy(rng, rng.choice(marker_words())))
    assert 6 <= len(marker_words()) <= 12
