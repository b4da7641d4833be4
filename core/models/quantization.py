"""QLoRA and attention-kernel choices for loading the policy's base model, checked before any weight is loaded.

`model.quantization=4bit` loads the frozen base in 4-bit NF4 with double quantization (QLoRA, Dettmers et al.
2023) through bitsandbytes, computing in the policy's dtype; the LoRA adapter stays in full precision, so only the
base's memory shrinks. That needs a CUDA GPU and the `bitsandbytes` package, and a run without them would fail
deep inside `from_pretrained` with a message that names neither the setting nor the way back; here it fails first,
naming both. Likewise `model.attn_implementation=flash_attention_2` needs the `flash_attn` package and a GPU.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal, get_args

import torch

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig

QuantizationMode = Literal["none", "4bit"]
QUANTIZATION_MODES: tuple[str, ...] = get_args(QuantizationMode)

AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]
ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)

# What flash-attn computes in: it has no float32 kernels.
FLASH_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


class QuantizationError(RuntimeError):
    """The base model cannot be loaded as configured (quantization or attention kernel); the message says why and
    which setting to change."""


def bitsandbytes_available() -> bool:
    """Whether `import bitsandbytes` can work (found without importing it: its import probes the GPU)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def quantization_config(
    mode: QuantizationMode, compute_dtype: torch.dtype, device: torch.device
) -> BitsAndBytesConfig | None:
    """None for `none`; for `4bit`, the QLoRA `BitsAndBytesConfig` (NF4, double quantization, computing in
    `compute_dtype`) to pass to `from_pretrained(quantization_config=...)`.

    Raises QuantizationError for an unknown mode, a device that is not CUDA, or a missing bitsandbytes.
    """
    if mode not in QUANTIZATION_MODES:
        raise QuantizationError(f"model.quantization is {mode!r}: use one of {list(QUANTIZATION_MODES)}")
    if mode == "none":
        return None
    if device.type != "cuda":
        raise QuantizationError(
            f"model.quantization=4bit (QLoRA) needs a CUDA GPU, but the policy runs on {device.type}: set "
            "model.quantization=none on CPU (or run on a GPU: run.device=cuda)"
        )
    if not bitsandbytes_available():
        raise QuantizationError(
            "model.quantization=4bit (QLoRA) needs the bitsandbytes package, which is not installed: "
            "pip install bitsandbytes (or pip install 'redteam-grpo[gpu]'), or set model.quantization=none"
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def check_attn_implementation(
    name: str, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> AttnImplementation:
    """`name` if the base model can be loaded with that attention kernel (`from_pretrained(attn_implementation=)`),
    else QuantizationError naming what is missing. `sdpa` and `eager` work everywhere; `flash_attention_2` needs
    the `flash_attn` package and, when they are given, a CUDA `device` and a float16 / bfloat16 `dtype`."""
    if name not in ATTN_IMPLEMENTATIONS:
        raise QuantizationError(f"model.attn_implementation is {name!r}: use one of {list(ATTN_IMPLEMENTATIONS)}")
    if name != "flash_attention_2":
        return name  # type: ignore[return-value]
    way_back = "or set model.attn_implementation=sdpa"
    if not flash_attn_available():
        raise QuantizationError(
            "model.attn_implementation=flash_attention_2 needs the flash_attn package, which is not installed: "
            f"pip install flash-attn --no-build-isolation (CUDA GPUs only), {way_back}"
        )
    if device is not None and device.type != "cuda":
        raise QuantizationError(
            f"model.attn_implementation=flash_attention_2 runs on CUDA GPUs only, but the policy runs on "
            f"{device.type}: {way_back.removeprefix('or ')}"
        )
    if dtype is not None and dtype not in FLASH_ATTENTION_DTYPES:
        raise QuantizationError(
            f"model.attn_implementation=flash_attention_2 computes in float16 or bfloat16 only, but model.dtype is "
            f"{str(dtype).removeprefix('torch.')}: set model.dtype=bfloat16, {way_back}"
        )
    return "flash_attention_2"
