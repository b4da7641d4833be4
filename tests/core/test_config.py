import json
import re
from pathlib import Path

import pytest
import yaml

from redteam_grpo.core.config import (
    Config,
    ConfigError,
    config_differences,
    documented_defaults,
    load_config,
)


def test_defaults_follow_the_reference_system_weights():
    cfg = Config()
    assert (cfg.reward.harm_weight, cfg.reward.repetition_weight, cfg.reward.kl_weight) == (1.0, 0.3, 0.1)
    assert (cfg.run.early_stop_reward, cfg.run.early_stop_repetition) == (0.8, 0.5)
    assert cfg.model.lora_rank == 16


def test_yaml_file_then_dotted_overrides(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("reward:\n  kl_weight: 0.5\nsampling:\n  group_size: 4\n")
    cfg = load_config(path, ["reward.kl_weight=0.2", "data.max_prompts=null", "model.lora_target_modules=[q_proj]"])
    assert cfg.reward.kl_weight == 0.2 and cfg.sampling.group_size == 4
    assert cfg.model.lora_target_modules == ["q_proj"]


def test_json_file(tmp_path):
    path = tmp_path / "my.json"
    path.write_text(json.dumps({"run": {"iterations": 3}}))
    assert load_config(path).run.iterations == 3


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("reward.kl_weigth=0.2", "reward.kl_weigth: unknown key (did you mean `kl_weight`?)"),
        ("rewrd.kl_weight=0.2", "rewrd: unknown key (did you mean `reward`?)"),
        ("sampling.group_size=1", "sampling.group_size"),
        ("training.learning_rate=fast", "training.learning_rate"),
    ],
)
def test_bad_keys_and_values_are_named(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert named in str(err.value)


def test_unknown_key_in_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("reward:\n  toxic_lable: toxic\n")
    with pytest.raises(ConfigError, match=r"reward.toxic_lable: unknown key \(did you mean `toxic_label`\?\)"):
        load_config(path)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("sampling.top_p=0.9", "sampling.top_p: removed: RL sampling keeps the distribution the trainer replays"),
        ("sampling.top_k=50", "sampling.top_k: removed"),
        ("sampling.min_new_tokens=5", "sampling.min_new_tokens: removed: it changes the sampled distribution"),
        ("sampling.repetition_penalty=1.2", "sampling.repetition_penalty: removed"),
        ("training.kl_beta=0.2", "training.kl_beta: moved to reward.kl_weight"),
        ("reward.repetition_penalty=0.2", "reward.repetition_penalty: renamed reward.repetition_weight"),
        ("reward.toxicity_weight=0.0", "reward.toxicity_weight: renamed reward.harm_weight"),
    ],
)
def test_settings_that_change_the_sampled_distribution_or_moved_are_refused_naming_the_way_out(setting, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting])
    assert named in str(err.value)


def test_inference_options_hold_what_rl_sampling_refuses():
    from redteam_grpo.core.config import InferenceConfig

    options = InferenceConfig(top_p=0.9, top_k=50, min_new_tokens=3, repetition_penalty=1.2)
    assert (options.top_p, options.top_k, options.min_new_tokens, options.repetition_penalty) == (0.9, 50, 3, 1.2)


def test_documented_defaults_parse_back_to_the_defaults_and_document_every_field():
    text = documented_defaults()
    assert Config.model_validate(yaml.safe_load(text)) == Config()
    for section, field in Config.model_fields.items():
        for key in field.annotation.model_fields:
            assert f"\n  {key}:" in text, f"{section}.{key} missing"
    assert text.count("  # ") >= sum(len(f.annotation.model_fields) for f in Config.model_fields.values())


def test_config_differences_names_fields():
    a = Config()
    b = load_config(None, ["reward.kl_weight=0.3", "sampling.group_size=4"])
    assert config_differences(a, b) == ["reward.kl_weight", "sampling.group_size"]


def test_malformed_file_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_loss_family_defaults_are_the_papers_values():
    t = Config().training
    assert t.loss == "importance_sampling" and t.loss_normalization == "token"
    assert (t.ppo_clip_epsilon_low, t.ppo_clip_epsilon_high) == (0.2, 0.28)  # DAPO
    assert (t.gspo_epsilon_low, t.gspo_epsilon_high) == (3e-4, 4e-4)  # GSPO, section 5.1
    assert t.mismatch_correction == "auto" and t.dynamic_sampling is False
    assert t.correction("hf") == "none" and t.correction("vllm") == "token_truncate" and t.mismatch_bounds == (None, 2)


@pytest.mark.parametrize(
    ("method", "bounds"),
    [
        ("token_truncate", (None, 2.0)),  # Yao et al. 2025's C
        ("sequence_truncate", (None, 3.0)),  # TRL's vllm_importance_sampling_clip_max
        ("sequence_mask", (None, 3.0)),  # the same TRL default
        ("icepop", (0.5, 5.0)),  # IcePop's [alpha, beta]
    ],
)
def test_each_mismatch_correction_has_its_own_bounds_and_a_set_bound_replaces_them(method, bounds):
    t = load_config(None, [f"training.mismatch_correction={method}"]).training
    assert t.correction("hf") == method and t.correction("vllm") == method and t.mismatch_bounds == bounds
    t = load_config(None, [f"training.mismatch_correction={method}", "training.mismatch_ratio_high=4"]).training
    assert t.mismatch_bounds == (bounds[0], 4.0)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["training.gspo_epsilon_low=0.01"], "training.gspo_epsilon_low only applies to training.loss=gspo"),
        (["training.loss=gspo", "training.ppo_clip_epsilon_high=0.3"], "set training.loss=ppo_clip, or leave"),
        (
            ["training.loss=ppo_clip", "training.ppo_clip_epsilon_low=1.0"],
            "training.ppo_clip_epsilon_low=1.0 must be in (0, 1)",
        ),
        (["training.loss=gspo", "training.gspo_epsilon_high=0"], "training.gspo_epsilon_high=0.0 must be > 0"),
        (
            ["training.mismatch_correction=token_truncate", "training.mismatch_ratio_high=0.5"],
            "training.mismatch_ratio_high=0.5 must be >= 1",
        ),
        (
            ["training.mismatch_correction=icepop", "training.mismatch_ratio_low=2"],
            "training.mismatch_ratio_low=2.0 must be <= 1",
        ),
        (
            ["training.mismatch_ratio_high=3"],
            "set training.mismatch_correction to token_truncate, sequence_truncate, sequence_mask or icepop",
        ),
        (
            ["training.mismatch_correction=sequence_truncate", "training.mismatch_ratio_high=0.9"],
            "training.mismatch_ratio_high=0.9 must be >= 1",
        ),
        (["training.truncated_is_cap=2"], "replaced by training.mismatch_correction=token_truncate"),
        (["training.ratio_tolerance=0.05"], "replaced by training.first_update_kl_tolerance"),
        (["training.loss=dapo"], "training.loss"),
        (["training.loss_normalization=length"], "training.loss_normalization"),
    ],
)
def test_loss_settings_that_cannot_work_are_named_with_the_way_out(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert named in str(err.value)


def test_the_replaced_clip_epsilon_is_refused_naming_the_ppo_clip_settings():
    with pytest.raises(ConfigError, match=r"training\.clip_epsilon: replaced by training\.loss=ppo_clip"):
        load_config(None, ["training.clip_epsilon=0.2"])


@pytest.mark.parametrize(
    "setting, named",
    [
        ("training.learning_rate=.inf", "Input should be a finite number"),
        ("training.learning_rate=nan", "Input should be a finite number"),
        ("reward.kl_weight=inf", "Input should be a finite number"),
        ("training.learning_rate=30", "Input should be less than or equal to 1"),
    ],
)
def test_a_non_finite_or_absurd_setting_is_refused_naming_it(setting, named):
    with pytest.raises(ConfigError, match=rf"{re.escape(setting.split('=')[0])}: {named}"):
        load_config(None, [setting])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.max_staleness=2"], r"training.max_staleness.*less than or equal to 1"),
        (
            ["training.max_staleness=1", "training.mismatch_correction=none"],
            r"training.max_staleness=1 trains on rollouts drawn by older weights.*mismatch_correction",
        ),
    ],
)
def test_one_step_off_policy_at_most_and_never_without_a_correction(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_hardening_is_given_one_length_and_the_paper_config_gives_it_in_steps():
    """A hardening is `active.harden_steps` optimizer steps (the paper's unit: 200 per round) or
    `active.harden_epochs` passes; both set is refused naming the way out."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["active.harden_steps=20", "active.harden_epochs=3"], mode="active")
    assert "set one" in str(err.value) and "active.harden_steps=null" in str(err.value)
    passes = load_config(None, ["active.harden_steps=null", "active.harden_epochs=3"], mode="active").active
    assert (passes.harden_steps, passes.harden_epochs) == (None, 3)
    paper = load_config(Path(__file__).parents[2] / "configs" / "active-qwen3-4b.yaml", [], mode="active").active
    assert (paper.harden_steps, paper.harden_epochs, paper.learning_rate) == (200, 1, 3e-5)
