"""Share a checkpoint's LoRA adapter on the Hugging Face hub, as a folder `PeftModel.from_pretrained` loads.

A checkpoint holds `adapter.safetensors` (`get_peft_model_state_dict` output, keys like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: exactly what PEFT saves), the optimizer
state, and a manifest naming the base model and the LoRA shape. `export_adapter_folder` turns it into PEFT's own
layout: the same tensors as `adapter_model.safetensors`, an `adapter_config.json` written by `peft.LoraConfig`
(so its fields are the installed PEFT's), and a model card. `push_adapter` uploads only that folder, so the
optimizer state never leaves the machine, into a repository that is private unless asked otherwise: the
adapter was trained to push a model into unsafe output.

The token comes from the caller or `HF_TOKEN`, never from a file of the run; without one nothing is sent.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, is_offline_mode
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import load, save_file

from redteam_grpo.storage import checkpoints

# PEFT's file names (peft.utils.SAFETENSORS_WEIGHTS_NAME, peft.utils.CONFIG_NAME): what from_pretrained looks for.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
MODEL_CARD_FILE = "README.md"
EXPORTED_FILES = (ADAPTER_WEIGHTS_FILE, ADAPTER_CONFIG_FILE, MODEL_CARD_FILE)
TOKEN_VARIABLE = "HF_TOKEN"

# `base_model.model.<module path>.lora_A.weight`: get_peft_model_state_dict's names, the adapter name left out.
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")


class HubError(RuntimeError):
    """An adapter cannot be exported or pushed; the message says why and what to do."""


def export_adapter_folder(
    checkpoint_dir: Path, out_dir: Path, *, base_model: str | None = None, repo_id: str | None = None
) -> Path:
    """Write the adapter of `checkpoint_dir` into `out_dir` as a PEFT adapter folder; returns `out_dir`.

    The checkpoint must verify (`checkpoints.read_manifest`). `base_model` replaces the manifest's base model in
    the adapter config and the card (for a model trained from a local copy of hub weights: the hub id of those very
    weights); `repo_id` is named in the card's loading example. `out_dir` may hold only files this function writes,
    so that uploading it sends nothing else.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    manifest = checkpoints.read_manifest(checkpoint_dir)
    if checkpoints.ADAPTER_FILE not in manifest.get("files", {}):
        raise HubError(f"{checkpoint_dir} holds no {checkpoints.ADAPTER_FILE}: choose a checkpoint of a training run")
    lora = manifest.get("lora") or {}
    missing = [key for key in ("rank", "alpha", "targets") if key not in lora] + (
        ["base_model"] if not manifest.get("base_model") else []
    )
    if missing:
        raise HubError(
            f"the manifest of {checkpoint_dir} does not record {missing}: the LoRA shape or base model is unknown, "
            "so no adapter config can be written. Export a checkpoint written by this version"
        )
    state = load((checkpoint_dir / checkpoints.ADAPTER_FILE).read_bytes())
    targets = _adapted_modules(state, checkpoint_dir, rank=int(lora["rank"]), recorded_targets=list(lora["targets"]))
    base = base_model or manifest["base_model"]

    out_dir.mkdir(parents=True, exist_ok=True)
    strangers = sorted(p.name for p in out_dir.iterdir() if p.name not in EXPORTED_FILES)
    if strangers:
        raise HubError(
            f"{out_dir} already holds {strangers[:5]}: an export folder holds only {list(EXPORTED_FILES)}, so an "
            "upload of it sends nothing else. Choose an empty or new folder"
        )
    save_file(state, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    _lora_config(base, manifest.get("base_revision"), lora, targets).save_pretrained(str(out_dir))
    card = _model_card(manifest, base, targets, repo_id or str(out_dir))
    (out_dir / MODEL_CARD_FILE).write_text(card, encoding="utf-8")
    return out_dir


def push_adapter(
    checkpoint_dir: Path,
    repo_id: str,
    token: str | None = None,
    private: bool = True,
    commit_message: str | None = None,
    *,
    base_model: str | None = None,
) -> str:
    """Upload the adapter of `checkpoint_dir` to the model repository `repo_id` (created if missing); returns the
    URL of the commit.

    Only the exported PEFT folder is sent (adapter weights, adapter config, model card), never the optimizer
    state or the manifest. `token` defaults to $HF_TOKEN. With `private` (the default) an existing public
    repository is refused: the hub applies `private` only when it creates a repository.
    """
    token = token or os.environ.get(TOKEN_VARIABLE) or None
    if token is None:
        raise HubError(
            f"no Hugging Face token to push {repo_id} with: set {TOKEN_VARIABLE} (a write token from "
            "https://huggingface.co/settings/tokens) or pass one. Tokens are never read from a run's files"
        )
    if is_offline_mode():
        raise HubError(
            f"pushing {repo_id} needs the network, but Hugging Face offline mode is on (HF_HUB_OFFLINE or "
            "TRANSFORMERS_OFFLINE, which run.offline=true sets): unset them for the push"
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise HubError(f"{repo_id!r} is not a hub repository id (`user/name` or `org/name`): {exc}") from None
    base = base_model or checkpoints.read_manifest(Path(checkpoint_dir)).get("base_model")
    _require_hub_model(base, checkpoint_dir)

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="redteam-grpo-adapter-") as tmp:
        folder = export_adapter_folder(Path(checkpoint_dir), Path(tmp) / "adapter", base_model=base, repo_id=repo_id)
        message = commit_message or f"LoRA adapter from {Path(checkpoint_dir).name} (redteam-grpo)"
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if private and api.repo_info(repo_id).private is False:
                raise HubError(
                    f"{repo_id} exists and is public, and the hub keeps an existing repository's visibility: make it "
                    "private on the hub, push to another repo_id, or pass private=False to publish the adapter"
                )
            commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=message)
        except HubError:
            raise
        except Exception as exc:  # HTTP, network and permission errors of huggingface_hub / httpx
            raise HubError(
                f"pushing the adapter to {repo_id} failed: {exc}. Check the network and that the token may write "
                "to that user or organisation; the push can simply be repeated"
            ) from exc
    return str(commit.commit_url)


def _adapted_modules(state: dict[str, Any], checkpoint_dir: Path, rank: int, recorded_targets: list[str]) -> list[str]:
    """The module names (last path component) the adapter's tensors adapt, checked against the manifest."""
    if not state:
        raise HubError(f"{checkpoint_dir / checkpoints.ADAPTER_FILE} holds no tensors: it is not a LoRA adapter")
    names = set()
    for key, tensor in state.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise HubError(
                f"{checkpoint_dir / checkpoints.ADAPTER_FILE} holds {key!r}, which is not a LoRA weight "
                "(base_model.model.<module>.lora_A/B.weight): it was not written by this project's policy"
            )
        tensor_rank = tensor.shape[0] if match["side"] == "A" else tensor.shape[-1]
        if tensor_rank != rank:
            raise HubError(
                f"{key} has rank {tensor_rank} but the manifest of {checkpoint_dir} records lora.rank={rank}: the "
                "checkpoint is inconsistent"
            )
        names.add(match["module"].rsplit(".", 1)[-1])
    unrecorded = sorted(names - set(recorded_targets))
    if unrecorded:
        raise HubError(
            f"{checkpoint_dir} adapts {unrecorded}, which its manifest's lora.targets {recorded_targets} do not "
            "name: the checkpoint is inconsistent"
        )
    return sorted(names)


def _lora_config(base: str, revision: str | None, lora: dict[str, Any], targets: list[str]):
    """The config `get_peft_model` was called with in core/models/policy.py (r, alpha, the modules found, causal LM)."""
    from peft import LoraConfig

    return LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=lora["alpha"],
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=targets,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
        revision=revision,
        inference_mode=True,  # as PeftModel.save_pretrained writes it
    )


def _require_hub_model(base: str | None, checkpoint_dir: Path) -> None:
    problem = None
    if not base:
        problem = "its manifest names no base model"
    elif Path(base).exists():
        problem = f"its base model {base!r} is a local folder"
    else:
        try:
            validate_repo_id(base)
        except HFValidationError:
            problem = f"its base model {base!r} is not a hub id (an embedded model or a local path)"
    if problem is not None:
        raise HubError(
            f"the adapter of {checkpoint_dir} cannot be loaded from the hub by anyone else: {problem}. Pass "
            "base_model=<the hub id of the very weights it was trained on>, or keep it local (export_adapter_folder)"
        )


def _model_card(manifest: dict[str, Any], base: str, targets: list[str], load_from: str) -> str:
    lora = manifest["lora"]
    revision = manifest.get("base_revision")
    metrics = {k: v for k, v in (manifest.get("metrics") or {}).items() if isinstance(v, int | float)}
    front_matter = {
        "base_model": base,
        "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": ["lora", "peft", "red-teaming", "redteam-grpo"],
    }
    lines = ["---", *(f"{key}: {json.dumps(value)}" for key, value in front_matter.items()), "---", ""]
    lines += [
        f"# LoRA adapter for {base}",
        "",
        "**Red-teaming model.** This adapter was trained with GRPO by redteam-grpo to push the base model into "
        "unsafe output. It is meant for safety research and evaluation only.",
        "",
        f"- base model: `{base}`" + (f" (revision `{revision}`)" if revision else ""),
        f"- run `{manifest.get('run_id')}`, iteration {manifest.get('iteration')}",
        f"- LoRA: r={lora['rank']}, alpha={lora['alpha']}, target modules {', '.join(targets)}",
        "- system prompt in training: "
        + (json.dumps(manifest["system_prompt"]) if manifest.get("system_prompt") else "none"),
    ]
    if manifest.get("quantization") == "4bit":
        lines.append("- trained on the base quantized to 4-bit NF4 (QLoRA)")
    if metrics:
        lines.append("- at this checkpoint: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
    lines += [
        "",
        "## Loading",
        "",
        "```python",
        "from peft import AutoPeftModelForCausalLM",
        "",
        f'model = AutoPeftModelForCausalLM.from_pretrained("{load_from}")',
        "```",
        "",
        "Prompts were formatted with the base model's chat template and the system prompt above.",
        "",
    ]
    return "\n".join(lines)
