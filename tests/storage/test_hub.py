"""The hub export builds a folder PEFT loads back to the same weights; the push sends only that folder.

Nothing here contacts the hub: the push tests replace `HfApi` with a recorder.
"""

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from transformers import Qwen3Config, Qwen3ForCausalLM

from redteam_grpo.storage import checkpoints, hub
from redteam_grpo.storage.hub import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    EXPORTED_FILES,
    MODEL_CARD_FILE,
    HubError,
    export_adapter_folder,
    push_adapter,
)

RANK, ALPHA = 4, 8
# As core/models/policy.py does: the configured targets, of which only those the model has are adapted.
CONFIGURED_TARGETS = ["q_proj", "v_proj", "w_not_in_qwen3"]
ADAPTED = ["q_proj", "v_proj"]
HUB_BASE = "Qwen/Qwen3-0.6B"  # only written into files: nothing is downloaded


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("base")
    tiny_qwen3().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained(base_dir):
    """A PEFT model as core/models/policy.py builds it, with a non-zero lora_B (a trained adapter), and its state."""
    model = get_peft_model(
        Qwen3ForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ADAPTED, task_type="CAUSAL_LM"),
    ).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return model, state


def make_checkpoint(folder: Path, state, base_model=HUB_BASE, rank=RANK, targets=CONFIGURED_TARGETS, **info) -> Path:
    """A sealed checkpoint as tasks/train_step.py + tasks/checkpoint.py write it."""
    folder.mkdir(parents=True)
    checkpoints.save_adapter(folder / checkpoints.ADAPTER_FILE, state)
    params = [torch.nn.Parameter(v.clone()) for v in state.values()]
    optimizer = torch.optim.AdamW(params)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    checkpoints.save_optimizer(folder / checkpoints.OPTIMIZER_FILE, optimizer)
    info = {
        **info,
        "run_id": "run-1",
        "iteration": 3,
        "base_model": base_model,
        "base_revision": "abc123",
        "lora": {"rank": rank, "alpha": ALPHA, "targets": targets},
        "system_prompt": "You are a helpful assistant.",
        "metrics": {"reward_mean": 0.25, "harm_mean": 0.5, "repetition_mean": 0.0, "kl_base_mean": 0.01},
    }
    checkpoints.write_manifest(folder, info)
    return folder


@pytest.fixture
def checkpoint(tmp_path, trained) -> Path:
    return make_checkpoint(tmp_path / "checkpoints" / "iter_0003", trained[1])


def test_the_key_names_are_peft_s_own(trained):
    _, state = trained
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in state


def test_the_exported_folder_loads_with_peft_to_the_same_weights_and_outputs(checkpoint, tmp_path, base_dir, trained):
    model, state = trained
    folder = export_adapter_folder(checkpoint, tmp_path / "export")
    assert sorted(p.name for p in folder.iterdir()) == sorted(EXPORTED_FILES)

    loaded = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(base_dir), folder).eval()
    loaded_state = get_peft_model_state_dict(loaded, save_embedding_layers=False)  # no hub look-up
    assert loaded_state.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(loaded_state[key], tensor), key
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        with loaded.disable_adapter():
            assert not torch.allclose(loaded(input_ids=ids).logits, expected)  # the adapter does something


def test_the_adapter_config_records_the_base_and_the_lora_shape(checkpoint, tmp_path):
    config = json.loads((export_adapter_folder(checkpoint, tmp_path / "export") / ADAPTER_CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == HUB_BASE
    assert config["revision"] == "abc123"
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(config["target_modules"]) == ADAPTED  # the modules adapted, not the configured list
    assert (config["task_type"], config["peft_type"]) == ("CAUSAL_LM", "LORA")


def test_the_model_card_says_what_the_adapter_is_and_how_to_load_it(checkpoint, tmp_path, trained):
    folder = export_adapter_folder(checkpoint, tmp_path / "export", repo_id="me/attacker")
    card = (folder / MODEL_CARD_FILE).read_text()
    assert card.startswith("---\n") and f'base_model: "{HUB_BASE}"' in card and 'library_name: "peft"' in card
    assert "Red-teaming model" in card and "safety research" in card
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/attacker")' in card
    assert "r=4, alpha=8" in card and "run `run-1`, iteration 3" in card
    assert "reward_mean 0.25" in card and "QLoRA" not in card
    qlora = make_checkpoint(tmp_path / "qlora", trained[1], quantization="4bit")
    assert "4-bit NF4 (QLoRA)" in (export_adapter_folder(qlora, tmp_path / "q") / MODEL_CARD_FILE).read_text()


def test_a_base_model_override_goes_into_config_and_card(checkpoint, tmp_path):
    folder = export_adapter_folder(checkpoint, tmp_path / "export", base_model="org/same-weights")
    assert json.loads((folder / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"] == "org/same-weights"
    assert "org/same-weights" in (folder / MODEL_CARD_FILE).read_text()


def test_a_corrupt_checkpoint_is_not_exported(checkpoint, tmp_path):
    adapter = checkpoint / checkpoints.ADAPTER_FILE
    adapter.write_bytes(adapter.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(checkpoints.CheckpointError, match="does not match its checksum"):
        export_adapter_folder(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_an_export_folder_with_other_files_is_refused(checkpoint, tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "optimizer.safetensors").write_bytes(b"x")
    with pytest.raises(HubError, match=r"already holds \['optimizer.safetensors'\].*empty or new folder"):
        export_adapter_folder(checkpoint, tmp_path / "export")
    export_adapter_folder(checkpoint, tmp_path / "again")
    export_adapter_folder(checkpoint, tmp_path / "again")  # its own files may be written over


def test_an_adapter_that_does_not_match_its_manifest_is_refused(tmp_path, trained):
    _, state = trained
    wrong_rank = make_checkpoint(tmp_path / "wrong_rank", state, rank=8)
    with pytest.raises(HubError, match=r"has rank 4 but the manifest .* records lora.rank=8"):
        export_adapter_folder(wrong_rank, tmp_path / "a")
    wrong_targets = make_checkpoint(tmp_path / "wrong_targets", state, targets=["q_proj"])
    with pytest.raises(HubError, match=r"adapts \['v_proj'\], which its manifest's lora.targets"):
        export_adapter_folder(wrong_targets, tmp_path / "b")
    not_lora = make_checkpoint(tmp_path / "not_lora", {**state, "model.embed_tokens.weight": torch.zeros(2, 2)})
    with pytest.raises(HubError, match=re.escape("'model.embed_tokens.weight', which is not a LoRA weight")):
        export_adapter_folder(not_lora, tmp_path / "c")


class FakeHfApi:
    """Records what a push would send; `public` pretends the repository already exists and is public."""

    instances: ClassVar[list["FakeHfApi"]] = []
    public = False
    fail_upload: Exception | None = None

    def __init__(self, token=None, **kwargs):
        self.token = token
        self.calls: list[tuple] = []
        self.uploaded: dict[str, bytes] = {}
        FakeHfApi.instances.append(self)

    def create_repo(self, repo_id, *, private=None, exist_ok=False, **kwargs):
        self.calls.append(("create_repo", repo_id, {"private": private, "exist_ok": exist_ok, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def repo_info(self, repo_id, **kwargs):
        self.calls.append(("repo_info", repo_id, kwargs))
        return type("Info", (), {"private": not FakeHfApi.public})()

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        self.calls.append(("upload_folder", repo_id, {"commit_message": commit_message, **kwargs}))
        if FakeHfApi.fail_upload is not None:
            raise FakeHfApi.fail_upload
        # read now: the temporary folder is gone after the push returns
        self.uploaded = {p.relative_to(folder_path).as_posix(): p.read_bytes() for p in Path(folder_path).rglob("*")}
        return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0123"})()


@pytest.fixture
def fake_hub(monkeypatch):
    FakeHfApi.instances, FakeHfApi.public, FakeHfApi.fail_upload = [], False, None
    monkeypatch.setattr(hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(hub, "is_offline_mode", lambda: False)  # the test session is offline; the fake is not
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return FakeHfApi


def test_push_creates_a_private_repo_and_uploads_only_the_adapter_folder(checkpoint, fake_hub, trained):
    url = push_adapter(checkpoint, "me/attacker", token="hf_secret", commit_message="iteration 3")
    (api,) = fake_hub.instances
    assert api.token == "hf_secret"
    assert api.calls[0] == ("create_repo", "me/attacker", {"private": True, "exist_ok": True})
    assert api.calls[-1] == ("upload_folder", "me/attacker", {"commit_message": "iteration 3"})
    assert url == "https://huggingface.co/me/attacker/commit/0123"
    assert sorted(api.uploaded) == sorted(EXPORTED_FILES)  # no optimizer, RNG state or manifest
    sent = load_safetensors(api.uploaded[ADAPTER_WEIGHTS_FILE])
    assert all(torch.equal(sent[k], v) for k, v in trained[1].items()) and sent.keys() == trained[1].keys()
    assert b"hf_secret" not in b"".join(api.uploaded.values())


def test_push_takes_the_token_from_hf_token_and_has_a_default_message(checkpoint, fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    push_adapter(checkpoint, "me/attacker")
    (api,) = fake_hub.instances
    assert api.token == "hf_from_env"
    assert "iter_0003" in api.calls[-1][2]["commit_message"]


def test_push_without_a_token_is_refused_before_anything_is_sent(checkpoint, fake_hub):
    with pytest.raises(HubError, match=r"no Hugging Face token .* set HF_TOKEN"):
        push_adapter(checkpoint, "me/attacker")
    assert fake_hub.instances == []


def test_push_in_offline_mode_says_to_unset_it(checkpoint, fake_hub, monkeypatch):
    monkeypatch.setattr(hub, "is_offline_mode", lambda: True)
    with pytest.raises(HubError, match=r"offline mode is on .* unset them"):
        push_adapter(checkpoint, "me/attacker", token="t")
    assert fake_hub.instances == []


@pytest.mark.parametrize("base", ["embedded:tiny-qwen3", "local folder"])
def test_push_refuses_a_base_model_nobody_else_can_load(tmp_path, trained, fake_hub, base_dir, base):
    base_model = str(base_dir) if base == "local folder" else base
    folder = make_checkpoint(tmp_path / "ckpt", trained[1], base_model=base_model)
    with pytest.raises(HubError, match=r"cannot be loaded from the hub by anyone else.*Pass base_model="):
        push_adapter(folder, "me/attacker", token="t")
    assert fake_hub.instances == []
    push_adapter(folder, "me/attacker", token="t", base_model="Qwen/Qwen3-0.6B")
    config = json.loads(fake_hub.instances[-1].uploaded[ADAPTER_CONFIG_FILE])
    assert config["base_model_name_or_path"] == "Qwen/Qwen3-0.6B"


def test_push_into_an_existing_public_repo_needs_private_false(checkpoint, fake_hub):
    fake_hub.public = True
    with pytest.raises(HubError, match=r"exists and is public.*private=False"):
        push_adapter(checkpoint, "me/attacker", token="t")
    assert all(call[0] != "upload_folder" for call in fake_hub.instances[-1].calls)
    push_adapter(checkpoint, "me/attacker", token="t", private=False)
    assert fake_hub.instances[-1].calls[0][2]["private"] is False
    assert fake_hub.instances[-1].uploaded


def test_a_failed_upload_names_the_repo_and_the_way_out(checkpoint, fake_hub):
    fake_hub.fail_upload = ConnectionError("connection reset")
    with pytest.raises(HubError, match=r"to me/attacker failed: connection reset.*can simply be repeated"):
        push_adapter(checkpoint, "me/attacker", token="t")


def test_a_malformed_repo_id_is_refused(checkpoint, fake_hub):
    with pytest.raises(HubError, match="is not a hub repository id"):
        push_adapter(checkpoint, "not a/valid/repo", token="t")
