"""Every model a run names is checked before any loads: a missing folder or an uncached hub id offline is one line
naming the setting, the model and the way out."""

import pytest

from redteam_grpo.core.models.policy import PolicyError, check_model_available

UNCACHED = "no-such-owner-0/no-such-model-0"


def test_embedded_models_and_existing_folders_pass(tmp_path):
    check_model_available("model.policy", "embedded:tiny-qwen3")
    check_model_available("model.policy", str(tmp_path))


def test_a_missing_folder_names_the_setting_and_the_way_out():
    with pytest.raises(PolicyError, match=r"^model\.policy=/no/such/dir: no such folder, .*Give the folder"):
        check_model_available("model.policy", "/no/such/dir")


def test_an_uncached_hub_id_offline_names_the_download_and_the_setting_that_allows_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PolicyError) as err:
        check_model_available("reward.scorer", UNCACHED)
    message = str(err.value)
    assert message.startswith(f"reward.scorer={UNCACHED}: not a folder, and not in the local Hugging Face cache")
    assert f"huggingface-cli download {UNCACHED}" in message and "run.offline=false" in message


def test_an_uncached_hub_id_online_is_left_to_download(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_model_available("model.policy", UNCACHED)
