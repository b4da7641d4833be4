"""Policy model: a base causal LM with a LoRA adapter per role; the reference is the same model, adapters disabled.

One copy of the base weights serves every role (`core/models/roles.py`): the trained adapter (`default`: the red-team
policy, or the defender), optionally an attacker's adapter (`ATTACKER`, defense mode), and the reference, which
cannot drift from the base or pick up adapter weights. Only the active adapter's parameters require gradients, and
a role is active only inside `policy.role(name)`, so an optimizer built on `trainable_parameters()` outside it
holds the default adapter alone. The model is kept in eval mode for every forward, so LoRA dropout never makes the
logprobs of the same tokens differ between sampling and training (the importance ratio stays exactly 1 on the
first update); `lora_dropout` is stored in the adapter config for compatibility only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from redteam_grpo.core.config import ModelConfig
from redteam_grpo.core.models.chat import end_of_turn_ids, turn_header_ids
from redteam_grpo.core.models.cpu_matmul import (
    contiguous_head_input,
    fast_frozen_linear_backward,
    needs_fast_backward,
)
from redteam_grpo.core.models.quantization import check_attn_implementation, quantization_config
from redteam_grpo.core.models.roles import DEFAULT_ROLE
from redteam_grpo.core.tokens.logprobs import SamplingDistribution
from redteam_grpo.core.tokens.masks import (
    PackedBatch,
    gather_completion_logits,
    logits_window,
    pack_sequences,
    pack_spans,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PolicyError(RuntimeError):
    """The policy cannot be trained as configured; the message says why and what to change."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PolicyError("run.device is 'cuda' but no CUDA device is visible: set run.device=cpu or auto")
    return torch.device(device)


def resolve_model_name(name: str) -> str:
    """Hub id or folder; `embedded:*` names are built offline on first use."""
    from redteam_grpo.embedded import is_embedded, resolve_model_path

    return resolve_model_path(name) if is_embedded(name) else name


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


TRUST_REMOTE_CODE_ENV = "REDTEAM_GRPO_TRUST_REMOTE_CODE"
_COMMIT = re.compile(r"[0-9a-f]{40}")


def remote_code_granted(cfg: ModelConfig) -> bool:
    """Whether the policy's own model code (a hub repo's `auto_map` .py files) may run: only when the person at the
    command line granted exactly this model, as `--trust-remote-code NAME@COMMIT` or REDTEAM_GRPO_TRUST_REMOTE_CODE,
    and model.revision pins that commit (a branch can be moved to other code after the grant). A local folder is
    granted by its path (whoever can write the folder chooses its code). Never from a config: a run folder or a
    deployment parameter names the model, not the permission. Any other model (a transfer target, a stored config
    naming another folder) loads with the architectures transformers ships, or is refused."""
    granted = os.environ.get(TRUST_REMOTE_CODE_ENV, "").strip()
    if not granted:
        return False
    if Path(cfg.policy).expanduser().is_dir():
        return Path(granted).expanduser().resolve() == Path(cfg.policy).expanduser().resolve()
    name, _, commit = granted.rpartition("@")
    if name != cfg.policy:
        return False
    if not _COMMIT.fullmatch(commit) or cfg.revision != commit:
        raise PolicyError(
            f"{TRUST_REMOTE_CODE_ENV}={granted} grants {cfg.policy}'s own code, but only at a pinned commit: grant "
            f"NAME@COMMIT (40 hex digits) and set model.revision to the same commit (now {cfg.revision!r})"
        )
    return True


def _refuse_remote_code(exc: Exception, cfg: ModelConfig) -> None:
    """transformers refuses a model that needs its own code: say how to grant it, where it says to edit the call."""
    if "trust_remote_code" in str(exc):
        pin = "" if Path(cfg.policy).expanduser().is_dir() else "@COMMIT (and model.revision=COMMIT)"
        raise PolicyError(
            f"{cfg.policy} needs its own model code, which runs only when granted on the command line: "
            f"`redteam-grpo --trust-remote-code {cfg.policy}{pin} ...` or {TRUST_REMOTE_CODE_ENV}. Read the code "
            "first; a run folder or config from someone else never grants it"
        ) from None


def check_model_available(setting: str, name: str, revision: str | None = None) -> None:
    """Before any model loads: `name` (the value of `setting`) is an embedded model, an existing folder, or a hub id
    that can be loaded: online, or in the local Hugging Face cache. Otherwise one PolicyError naming the setting,
    the model and the way out, where transformers would raise a page of traceback after other models loaded."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    from redteam_grpo.embedded import is_embedded

    if is_embedded(name) or Path(name).expanduser().exists():
        return
    try:
        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except HFValidationError:
        raise PolicyError(
            f"{setting}={name}: no such folder, and not a Hugging Face hub id (owner/name). Give the folder of a "
            "saved model, or a hub id."
        ) from None
    if _offline() and not isinstance(cached, str):
        raise PolicyError(
            f"{setting}={name}: not a folder, and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"runs are offline by default. Download it first (`huggingface-cli download {name}`), set "
            "run.offline=false to let the run download it, or give the folder of a saved model."
        )


def load_tokenizer(cfg: ModelConfig) -> Any:
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_name(cfg.policy), revision=cfg.revision, trust_remote_code=remote_code_granted(cfg)
        )
    except ValueError as exc:
        _refuse_remote_code(exc, cfg)
        raise
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        # Masks come from lengths, so pad == eos is safe here; generate only needs some pad id.
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(tokenizer, "chat_template", None) is None:
        raise PolicyError(f"{cfg.policy} has no chat template: use an instruct/chat model")
    if cfg.enable_thinking is not None:
        if "enable_thinking" not in tokenizer.chat_template:
            raise PolicyError(
                f"model.enable_thinking is set, but {cfg.policy}'s chat template does not read enable_thinking (a "
                "model without a thinking mode): unset model.enable_thinking"
            )
        # one place for every rendering (sampling, SFT, dialogues, evaluation; the engine gets these ids): the
        # template sees the setting as if each call passed enable_thinking=...
        flag = "true" if cfg.enable_thinking else "false"
        tokenizer.chat_template = "{%- set enable_thinking = " + flag + " -%}\n" + tokenizer.chat_template
    return tokenizer


@dataclass
class Policy:
    model: PeftModel
    tokenizer: Any
    end_of_turn_ids: list[int]
    turn_header_ids: list[int]
    distribution: SamplingDistribution
    device: torch.device

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the base computes in (model.dtype): that of its input embeddings, which neither LoRA nor 4-bit
        quantization changes."""
        return self.model.get_input_embeddings().weight.dtype

    @property
    def decoder_layers(self) -> int:
        """The number of decoder layers of the base (its config's num_hidden_layers): the depth the rounding noise
        of the logits grows with (core/training/train.py: first_update_tolerance)."""
        config = self.model.get_base_model().config
        return int(
            getattr(config, "num_hidden_layers", None) or getattr(config.get_text_config(), "num_hidden_layers", 1)
        )

    @property
    def hidden_size(self) -> int:
        """The width of the base's residual stream (its config's hidden_size): with the depth, what the rounding
        noise of the logits grows with (core/training/train.py: rounding_noise_scale)."""
        config = self.model.get_base_model().config
        return int(getattr(config, "hidden_size", None) or getattr(config.get_text_config(), "hidden_size", 1))

    def require_eval_mode(self) -> None:
        """Every forward that produces compared logprobs runs without dropout."""
        if self.model.training:
            raise PolicyError(
                "the policy is in training mode (dropout active): logprobs of the same tokens would differ "
                "between sampling and training. Call policy.model.eval()."
            )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base: the same weights with every adapter switched off."""
        with self.model.disable_adapter():
            yield

    def adapter_is_zero(self) -> bool:
        """Whether the active adapter adds exactly nothing to the base: every one of its LoRA B matrices is 0, as PEFT
        initialises them (a role's initial adapter, unless the run started from trained weights). A forward with it
        then gives the reference's logits bit for bit. False for an adapter with anything else that could differ
        (a DoRA magnitude), and where the active adapter has no LoRA layer at all."""
        active = self.model.active_adapter
        found = False
        for module in self.model.modules():
            magnitude = getattr(module, "lora_magnitude_vector", None)
            if magnitude is not None and active in magnitude:
                return False
            lora_b = getattr(module, "lora_B", None)
            if lora_b is None or active not in lora_b:
                continue
            found = True
            if torch.count_nonzero(lora_b[active].weight):
                return False
        return found

    @property
    def roles(self) -> list[str]:
        return list(self.model.peft_config)

    def add_role(self, name: str) -> None:
        """A second adapter of the same LoRA shape on the same base (seeded like the first by the caller)."""
        if name in self.model.peft_config:
            return
        self.model.add_adapter(name, self.model.peft_config[DEFAULT_ROLE])
        self.model.set_adapter(DEFAULT_ROLE)  # add_adapter may leave the new one trainable: only the default is
        self.model.eval()

    @contextlib.contextmanager
    def role(self, name: str) -> Iterator[None]:
        """Forward passes inside run with `name`'s adapter (and only its parameters require gradients)."""
        if name not in self.model.peft_config:
            raise PolicyError(f"the policy has no {name!r} adapter (roles: {self.roles})")
        self.model.set_adapter(name)
        try:
            yield
        finally:
            self.model.set_adapter(DEFAULT_ROLE)

    def adapter_state(self, role: str = DEFAULT_ROLE) -> dict[str, torch.Tensor]:
        # no embedding layers are adapted; 'auto' would look the base model up on the hub on every call
        state = get_peft_model_state_dict(self.model, adapter_name=role, save_embedding_layers=False)
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}

    def load_adapter_state(self, state: dict[str, torch.Tensor], role: str = DEFAULT_ROLE) -> None:
        expected = self.adapter_state(role)
        missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
        if missing or unexpected:
            raise PolicyError(
                f"adapter does not fit this policy: missing {sorted(missing)[:3]}, unexpected "
                f"{sorted(unexpected)[:3]}. Was it trained with another model.policy or lora settings?"
            )
        for key, tensor in state.items():
            if tensor.shape != expected[key].shape:
                raise PolicyError(
                    f"adapter tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(expected[key].shape)}"
                )
        set_peft_model_state_dict(self.model, state, adapter_name=role)

    def save_adapter(self, path: Path, role: str = DEFAULT_ROLE) -> None:
        save_file(self.adapter_state(role), str(path))

    def load_adapter(self, path: Path, role: str = DEFAULT_ROLE) -> None:
        # safetensors: no pickle, no code; read as bytes, so that a file on object storage (a UPath) loads too
        self.load_adapter_state(load_safetensors(path.read_bytes()), role)


def load_policy(cfg: ModelConfig, temperature: float, device: torch.device, seed: int) -> Policy:
    dtype = DTYPES[cfg.dtype]
    attn = check_attn_implementation(cfg.attn_implementation, device, dtype)  # before any weight is loaded
    quantization = quantization_config(cfg.quantization, dtype, device)
    tokenizer = load_tokenizer(cfg)
    try:
        base = AutoModelForCausalLM.from_pretrained(
            resolve_model_name(cfg.policy),
            revision=cfg.revision,
            dtype=dtype,
            trust_remote_code=remote_code_granted(cfg),
            attn_implementation=attn,
            quantization_config=quantization,
            # a 4-bit model is quantized as it is placed: put it on the device while loading, never `.to()` it after
            **({"device_map": {"": device}} if quantization is not None else {}),
        )
    except ValueError as exc:
        _refuse_remote_code(exc, cfg)
        raise
    if quantization is None:
        base = base.to(device)
    present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    targets = [m for m in cfg.lora_target_modules if m in present]
    if not targets:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)})
        raise PolicyError(
            f"none of model.lora_target_modules {cfg.lora_target_modules} exist in {cfg.policy}; "
            f"its linear layers are named {linear}"
        )
    torch.manual_seed(seed)  # LoRA A init is random: seed it so a run is reproducible
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    contiguous_head_input(base)  # generate's first step would copy the head's weight per row (cpu_matmul.py)
    model = get_peft_model(base, lora)
    if quantization is None and needs_fast_backward(device, dtype):
        fast_frozen_linear_backward(model)  # bfloat16 backward on a CPU without AVX-512: 40x faster
    model.eval()
    policy = _wrap(model, tokenizer, temperature, device)
    check_trainable(policy)
    return policy


def _wrap(model: PeftModel, tokenizer: Any, temperature: float, device: torch.device) -> Policy:
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eot = end_of_turn_ids(tokenizer, generation_eos)
    headers = turn_header_ids(tokenizer)
    pad = int(tokenizer.pad_token_id)
    # A random or weak policy samples pad and turn headers mid-response; forbid them (the trainer replays this).
    suppressed = tuple(sorted({*headers, *([pad] if pad not in eot else [])}))
    return Policy(model, tokenizer, eot, headers, SamplingDistribution(temperature, suppressed), device)


def check_trainable(policy: Policy) -> None:
    """Refuse a policy that would train "successfully" without changing anything (issue: no trainable params)."""
    params = policy.trainable_parameters()
    if not params or sum(p.numel() for p in params) == 0:
        raise PolicyError("the policy has no trainable parameters: check model.lora_target_modules and lora_rank")
    non_adapter = [n for n, p in policy.model.named_parameters() if p.requires_grad and "lora_" not in n]
    if non_adapter:
        raise PolicyError(f"parameters outside the LoRA adapter are trainable: {non_adapter[:3]}")


def completion_logits(policy: Policy, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]):
    """Logits predicting each completion token, from one forward on exactly the sampled ids: [B, C, V]."""
    return packed_logits(policy, pack_sequences(prompt_ids, completion_ids, policy.pad_id, padding="right"))


def span_logits(policy: Policy, sequences: Sequence[Sequence[int]], spans: Sequence[Sequence[tuple[int, int]]]):
    """Logits predicting the tokens of each sequence's spans (a dialogue role's own turns, core/rollouts/dialogue.py),
    from one forward on the whole dialogue as sampled: [B, C, V], with the spans' ids and mask."""
    return packed_logits(policy, pack_spans(sequences, spans, policy.pad_id, padding="right"))


def packed_logits(policy: Policy, packed: PackedBatch):
    policy.require_eval_mode()
    packed = packed.to(policy.device)
    out = policy.model(
        input_ids=packed.input_ids_B_T,
        attention_mask=packed.attention_mask_B_T,
        position_ids=packed.position_ids_B_T,
        use_cache=False,
        logits_to_keep=logits_window(packed),  # the head on the positions that predict a trained token alone
    )
    logits = gather_completion_logits(out.logits, packed).float()
    return logits, packed.completion_ids_B_C, packed.completion_mask_B_C
