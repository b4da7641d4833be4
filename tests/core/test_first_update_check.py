"""The first-update check tells rounding noise from misalignment: a correct bfloat16 run passes it at the default
tolerance, and each way of training on other tokens, ids or distributions than were sampled is refused in bfloat16
too. The misalignments are put into the batch or the trainer's distribution here, not into the code: each is one
of the misalignment bug classes of docs/bug-classes.md, as it would reach the update."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from redteam_grpo.core.config import ModelConfig, TrainingConfig
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import load_policy, load_tokenizer
from redteam_grpo.core.rollouts.logprobs import SamplingDistribution
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.training.train import RatioCheckError, TrainBatch, first_update_tolerance, make_optimizer
from redteam_grpo.core.training.train import policy_gradient_step as step

PROMPTS = [
    "Hi",
    "Tell me, in as much detail as you can manage, what you really think about the people who live next door.",
    "Describe my coworker.",
    "What is the weather like today where you live, and why?",
]


def _sampled_batch(policy, max_new_tokens=24) -> TrainBatch:
    prompt_ids = [format_prompt_ids(policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    completions = sample_completions(policy, prompt_ids, 4, max_new_tokens, batch_size=16, seed=0)
    return TrainBatch(
        prompt_ids=[prompt_ids[c.prompt_index] for c in completions],
        completion_ids=[c.completion_ids for c in completions],
        sample_logprobs=[c.sample_logprobs for c in completions],
        advantages=[float((-1) ** i) for i in range(len(completions))],
        group_ids=[str(c.prompt_index) for c in completions],
    )


@pytest.fixture(scope="module")
def wide_bfloat16_folder(tmp_path_factory, embedded_assets):
    """A random Qwen3 of hidden 512 x 8 layers in bfloat16 (built in bfloat16, no float32 copy), with the embedded
    tokenizer: wide enough that bfloat16 rounding moves logprobs by 3e-3 on average, as real models do more."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = load_tokenizer(ModelConfig())
    config = Qwen3Config(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    folder = tmp_path_factory.mktemp("wide-bf16")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_correct_bfloat16_run_at_width_passes_the_first_update_check_by_default(wide_bfloat16_folder):
    policy = load_policy(ModelConfig(policy=str(wide_bfloat16_folder), dtype="bfloat16"), 1.0, torch.device("cpu"), 0)
    cfg = TrainingConfig()  # every tolerance at its default
    stats = step(policy, make_optimizer(policy, cfg), _sampled_batch(policy), cfg)
    # the rounding noise is real: mean |ratio - 1| is several times the 1e-3 that a ratio check once required ...
    assert stats.first_ratio_abs_dev > 2e-3 and stats.logprob_mismatch_max > 5e-3
    # ... and second order in the KL, far below the bfloat16 tolerance
    assert stats.sampler_kl < first_update_tolerance(cfg, torch.bfloat16) / 10
    assert math.isfinite(stats.grad_norm) and stats.grad_norm > 0


def _shift_logprobs_one_token_late(policy, batch):  # mask-off-by-one: token t scored with t-1's logprob
    late = [[row[0], *row[:-1]] for row in batch.sample_logprobs]
    return dataclasses.replace(batch, sample_logprobs=late)


def _drop_the_first_prompt_id(policy, batch):  # trained-ids-differ-from-sampled: a BOS/header lost on the way
    return dataclasses.replace(batch, prompt_ids=[p[1:] for p in batch.prompt_ids])


def _forget_the_temperature(policy, batch):  # trainer-ignores-temperature: sampled at 0.7, trained at 1
    policy.distribution = SamplingDistribution(1.0, policy.distribution.suppressed_ids)
    return batch


def _forget_the_suppressed_ids(policy, batch):  # suppression-not-replayed
    policy.distribution = SamplingDistribution(policy.distribution.temperature, ())
    return batch


def _read_the_wrong_column(policy, batch):  # logprobs that are not the sampler's (recorded-as-zeros, stale)
    return dataclasses.replace(batch, sample_logprobs=[[0.0] * len(row) for row in batch.sample_logprobs])


@pytest.mark.parametrize(
    "misalign",
    [
        _shift_logprobs_one_token_late,
        _drop_the_first_prompt_id,
        _forget_the_temperature,
        _forget_the_suppressed_ids,
        _read_the_wrong_column,
    ],
)
def test_each_misalignment_is_refused_in_bfloat16_at_the_default_tolerance(embedded_assets, misalign):
    policy = load_policy(ModelConfig(dtype="bfloat16"), 0.7, torch.device("cpu"), 0)
    vocab = len(policy.tokenizer)
    # a sampler that forbids a quarter of the vocabulary, so that forgetting it is not lost in rounding
    suppressed = tuple(sorted({*policy.distribution.suppressed_ids, *range(vocab // 4, vocab // 2)}))
    policy.distribution = SamplingDistribution(0.7, suppressed)
    batch = _sampled_batch(policy)
    cfg = TrainingConfig()
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    correct = step(policy, make_optimizer(policy, cfg), batch, cfg)  # the same batch, aligned: accepted
    assert correct.sampler_kl < first_update_tolerance(cfg, torch.bfloat16) / 10
    policy.load_adapter_state(before)  # back to the sampling weights
    misaligned = misalign(policy, batch)
    with pytest.raises(RatioCheckError, match="does not see the distribution the tokens were sampled from"):
        step(policy, make_optimizer(policy, cfg), misaligned, cfg)
    assert all(torch.equal(before[k], v) for k, v in policy.adapter_state().items())  # nothing was applied


def test_the_default_tolerance_follows_the_compute_dtype_depth_and_logit_scale_and_a_set_one_wins():
    eps2 = 2.0**-14  # bfloat16
    assert first_update_tolerance(TrainingConfig(), torch.float32) == 1e-6
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16) == pytest.approx(16 * eps2)
    assert first_update_tolerance(TrainingConfig(), torch.float16) == pytest.approx(16 * 2.0**-20)
    # a shallow model or flat logits: the dtype's bound; a deep one with spread logits: one eps^2 per layer and unit
    # of variance (a random Qwen3-4B with logits of standard deviation 5 measured 6.5e-3 against this 5.5e-2)
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, layers=8, logit_scale=1.0) == 16 * eps2
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, layers=36, logit_scale=1.0) == 36 * eps2
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, layers=36, logit_scale=25.0) == 900 * eps2
    assert first_update_tolerance(TrainingConfig(), torch.float32, layers=36, logit_scale=25.0) == 1e-6
    set_one = TrainingConfig(first_update_kl_tolerance=0.5)
    assert first_update_tolerance(set_one, torch.float32) == 0.5
    assert first_update_tolerance(set_one, torch.bfloat16, layers=36, logit_scale=25.0) == 0.5


def test_the_tolerance_grows_with_a_deep_models_spread_logits_and_still_refuses_a_misalignment(wide_bfloat16_folder):
    policy = load_policy(ModelConfig(policy=str(wide_bfloat16_folder), dtype="bfloat16"), 0.7, torch.device("cpu"), 0)
    with torch.no_grad():  # tied: the logits spread 5x (squared scale about 5 at this width)
        policy.model.get_input_embeddings().weight.mul_(5.0)
    batch = _sampled_batch(policy)
    cfg = TrainingConfig()
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    correct = step(policy, make_optimizer(policy, cfg), batch, cfg)
    layers = policy.decoder_layers
    assert layers == 8
    # the bound the step used is the depth times the logits' squared scale, above the dtype's 16 eps^2
    logit_scale = correct.sampler_kl_tolerance / (layers * torch.finfo(torch.bfloat16).eps ** 2)
    assert 2.0 < logit_scale < 20.0
    assert correct.sampler_kl_tolerance > first_update_tolerance(cfg, torch.bfloat16)
    assert correct.sampler_kl < correct.sampler_kl_tolerance / 10
    policy.load_adapter_state(before)
    with pytest.raises(RatioCheckError, match="8 layers, logit scale"):
        step(policy, make_optimizer(policy, cfg), _drop_the_first_prompt_id(policy, batch), cfg)
