import importlib.util

import pytest
import torch

from redteam_grpo.core.models import quantization
from redteam_grpo.core.models.quantization import (
    ATTN_IMPLEMENTATIONS,
    QUANTIZATION_MODES,
    QuantizationError,
    check_attn_implementation,
    quantization_config,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU unless one is there
HAS_BNB_AND_CUDA = torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_no_quantization_is_no_config_on_any_device(device):
    assert quantization_config("none", torch.float32, device) is None


def test_4bit_on_cpu_says_it_needs_a_gpu_and_how_to_turn_it_off():
    with pytest.raises(QuantizationError, match=r"needs a CUDA GPU.*set model.quantization=none on CPU"):
        quantization_config("4bit", torch.float32, CPU)


def test_4bit_without_bitsandbytes_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(quantization, "bitsandbytes_available", lambda: False)
    with pytest.raises(QuantizationError, match=r"pip install bitsandbytes.*or set model.quantization=none"):
        quantization_config("4bit", torch.bfloat16, CUDA)


def test_an_unknown_mode_lists_the_modes():
    with pytest.raises(QuantizationError, match=r"'8bit': use one of \['none', '4bit'\]"):
        quantization_config("8bit", torch.float32, CPU)  # type: ignore[arg-type]


def assert_qlora_settings(config, compute_dtype):
    assert config.load_in_4bit and not config.load_in_8bit
    assert config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_use_double_quant is True
    assert config.bnb_4bit_compute_dtype == compute_dtype


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float16])
def test_4bit_is_nf4_with_double_quantization_in_the_compute_dtype(monkeypatch, compute_dtype):
    # Building the config needs neither bitsandbytes nor a GPU: pretend both are there to check what is built.
    monkeypatch.setattr(quantization, "bitsandbytes_available", lambda: True)
    assert_qlora_settings(quantization_config("4bit", compute_dtype, CUDA), compute_dtype)


@pytest.mark.skipif(not HAS_BNB_AND_CUDA, reason="needs a CUDA GPU and bitsandbytes (pip install bitsandbytes)")
def test_4bit_loads_a_tiny_model_with_4bit_linear_layers(tmp_path):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config = quantization_config("4bit", torch.bfloat16, CUDA)
    assert_qlora_settings(config, torch.bfloat16)
    tiny = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    Qwen3ForCausalLM(tiny).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, dtype=torch.bfloat16, device_map={"": 0}, attn_implementation="sdpa"
    )
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    logits = model(input_ids=torch.tensor([[1, 2, 3]], device="cuda")).logits
    assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["sdpa", "eager"])
def test_sdpa_and_eager_work_everywhere(name):
    assert check_attn_implementation(name, CPU, torch.float32) == name


def test_an_unknown_attention_lists_the_supported_ones():
    with pytest.raises(QuantizationError, match=r"'flex': use one of \['sdpa', 'eager', 'flash_attention_2'\]"):
        check_attn_implementation("flex")


def test_flash_attention_without_flash_attn_says_how_to_install_it_or_go_back_to_sdpa(monkeypatch):
    monkeypatch.setattr(quantization, "flash_attn_available", lambda: False)
    with pytest.raises(QuantizationError, match=r"needs the flash_attn package.*set model.attn_implementation=sdpa"):
        check_attn_implementation("flash_attention_2", CUDA, torch.bfloat16)


def test_flash_attention_needs_a_gpu_and_a_half_precision_dtype(monkeypatch):
    monkeypatch.setattr(quantization, "flash_attn_available", lambda: True)
    assert check_attn_implementation("flash_attention_2", CUDA, torch.bfloat16) == "flash_attention_2"
    assert check_attn_implementation("flash_attention_2") == "flash_attention_2"  # nothing known to check against
    with pytest.raises(QuantizationError, match=r"CUDA GPUs only, but the policy runs on cpu"):
        check_attn_implementation("flash_attention_2", CPU, torch.bfloat16)
    with pytest.raises(QuantizationError, match=r"model.dtype is float32: set model.dtype=bfloat16"):
        check_attn_implementation("flash_attention_2", CUDA, torch.float32)


def test_a_policy_with_qlora_on_cpu_is_refused_before_any_weight_is_loaded(monkeypatch):
    from typing import get_args

    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models import policy as policy_module

    assert get_args(ModelConfig.model_fields["quantization"].annotation) == QUANTIZATION_MODES
    assert get_args(ModelConfig.model_fields["attn_implementation"].annotation) == ATTN_IMPLEMENTATIONS

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the setting was checked")

    monkeypatch.setattr(policy_module.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(policy_module, "load_tokenizer", no_loading)
    with pytest.raises(QuantizationError, match=r"model.quantization=none"):
        policy_module.load_policy(ModelConfig(quantization="4bit"), 1.0, torch.device("cpu"), 0)
