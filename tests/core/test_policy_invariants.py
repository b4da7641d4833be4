"""Invariants of sampler, reference and trainer on the embedded tiny model."""

import math

import pytest
import torch

from redteam_grpo.core.config import ModelConfig, TrainingConfig
from redteam_grpo.core.models.chat import format_prompt_ids, format_sft_ids
from redteam_grpo.core.models.policy import PolicyError, completion_logits, load_policy
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.masks import gather_completion_logits, pack_sequences
from redteam_grpo.core.training.kl import policy_reference_logprobs, sequence_kl
from redteam_grpo.core.training.train import TrainBatch, make_optimizer, policy_gradient_step

PROMPTS = [
    "Hi",
    "Tell me, in as much detail as you can manage, what you really think about the people who live next door.",
    "Describe my coworker.",
]


def _sample(policy, group_size=4, seed=0, max_new_tokens=16):
    prompt_ids = [format_prompt_ids(policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    completions = sample_completions(policy, prompt_ids, group_size, max_new_tokens, batch_size=8, seed=seed)
    return prompt_ids, completions


def _batch(prompt_ids, completions, advantages=None):
    return TrainBatch(
        prompt_ids=[prompt_ids[c.prompt_index] for c in completions],
        completion_ids=[c.completion_ids for c in completions],
        sample_logprobs=[c.sample_logprobs for c in completions],
        advantages=advantages or [float((-1) ** i) for i in range(len(completions))],
        group_ids=[str(c.prompt_index) for c in completions],
    )


def test_prompts_of_very_different_lengths_are_sampled_with_left_padding_and_cut_correctly(tiny_policy):
    prompt_ids, completions = _sample(tiny_policy)
    lengths = {len(p) for p in prompt_ids}
    assert len(lengths) == 3  # really different lengths, so left padding is exercised
    eot = set(tiny_policy.end_of_turn_ids)
    headers = set(tiny_policy.turn_header_ids)
    for c in completions:
        assert len(c.completion_ids) == len(c.sample_logprobs) > 0
        assert not headers & set(c.completion_ids)  # no chat header (the prompt) inside a response
        ends = [i for i, t in enumerate(c.completion_ids) if t in eot]
        if c.finish_reason == "stop":
            assert ends == [len(c.completion_ids) - 1]  # exactly one end-of-turn, and it is last
        else:
            assert ends == [] and len(c.completion_ids) == 16


def test_first_update_ratio_is_one_and_kl_is_zero(tiny_policy):
    prompt_ids, completions = _sample(tiny_policy)
    batch = _batch(prompt_ids, completions)
    pol, ref, mask = policy_reference_logprobs(tiny_policy, batch.prompt_ids, batch.completion_ids)
    assert sequence_kl(pol, ref, mask).abs().max() == 0.0  # LoRA B starts at 0: policy == base exactly
    stats = policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, TrainingConfig()), batch, TrainingConfig())
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert stats.ratio_max == pytest.approx(1.0, abs=1e-4)
    assert stats.first_ratio_abs_dev < 1e-5
    assert stats.sampler_kl == pytest.approx(0.0, abs=1e-8)
    assert math.isnan(stats.last_ratio_std)  # one update per batch: there is no later ratio


def test_ratio_moves_away_from_one_after_an_update_on_the_same_batch(tiny_policy):
    prompt_ids, completions = _sample(tiny_policy)
    cfg = TrainingConfig(updates_per_batch=2, learning_rate=1e-2)
    stats = policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), _batch(prompt_ids, completions), cfg)
    assert stats.ratio_std < 1e-5
    assert stats.last_ratio_std > 1e-3


def test_reference_logprobs_do_not_change_when_the_adapter_trains(tiny_policy):
    prompt_ids, completions = _sample(tiny_policy)
    batch = _batch(prompt_ids, completions)
    pol_before, ref_before, _ = policy_reference_logprobs(tiny_policy, batch.prompt_ids, batch.completion_ids)
    cfg = TrainingConfig(learning_rate=1e-2, updates_per_batch=3)
    policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg)
    pol_after, ref_after, _ = policy_reference_logprobs(tiny_policy, batch.prompt_ids, batch.completion_ids)
    assert torch.equal(ref_before, ref_after)
    assert (pol_before - pol_after).abs().max() > 1e-3


def test_every_adapter_parameter_gets_a_gradient_and_nothing_outside_the_adapter_changes(tiny_policy):
    prompt_ids, completions = _sample(tiny_policy)
    frozen_before = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters() if not p.requires_grad}
    cfg = TrainingConfig(updates_per_batch=2)  # LoRA B is 0 at init, so A only gets a gradient on step 2
    optimizer = make_optimizer(tiny_policy, cfg)
    adapter_before = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters() if p.requires_grad}
    policy_gradient_step(tiny_policy, optimizer, _batch(prompt_ids, completions), cfg)
    named = dict(tiny_policy.model.named_parameters())
    assert adapter_before
    for name, before in adapter_before.items():
        assert named[name].grad is not None and named[name].grad.abs().sum() > 0, name
        assert not torch.equal(named[name].detach(), before), f"{name} did not change"
    for name, before in frozen_before.items():
        assert torch.equal(named[name].detach(), before), f"{name} outside the adapter changed"


def test_training_forward_sees_exactly_the_ids_the_sampler_fed_and_drew(tiny_policy):
    seen = []
    hook = tiny_policy.model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0]))
    prompt_ids, completions = _sample(tiny_policy, group_size=2)
    sampler_prompt_inputs = seen[0]  # first generate step: the left-padded prompts
    seen.clear()
    batch = _batch(prompt_ids, completions)
    policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, TrainingConfig()), batch, TrainingConfig())
    hook.remove()
    train_inputs = seen[0]
    pad = tiny_policy.pad_id
    for b, c in enumerate(completions):
        fed = [t for t in sampler_prompt_inputs[b].tolist()]
        fed = fed[len(fed) - len(prompt_ids[c.prompt_index]) :]
        row = train_inputs[b].tolist()
        n = len(prompt_ids[c.prompt_index]) + len(c.completion_ids)
        assert row[:n] == fed + c.completion_ids
        assert all(t == pad for t in row[n:])


def test_the_trainers_logits_are_those_of_a_forward_over_every_position_though_the_head_sees_the_window_only(
    tiny_policy,
):
    prompt_ids, completions = _sample(tiny_policy, group_size=2)
    batch = _batch(prompt_ids, completions)
    head_inputs = []
    head = tiny_policy.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, args, out: head_inputs.append(args[0].shape[1]))
    with torch.no_grad():
        logits, ids, mask = completion_logits(tiny_policy, batch.prompt_ids, batch.completion_ids)
    hook.remove()
    packed = pack_sequences(batch.prompt_ids, batch.completion_ids, tiny_policy.pad_id, padding="right")
    with torch.no_grad():
        every_position = tiny_policy.model(
            input_ids=packed.input_ids_B_T,
            attention_mask=packed.attention_mask_B_T,
            position_ids=packed.position_ids_B_T,
            use_cache=False,
        ).logits
    expected = gather_completion_logits(every_position, packed).float()
    assert torch.equal(ids, packed.completion_ids_B_C) and torch.equal(mask, packed.completion_mask_B_C)
    assert torch.allclose(logits[mask], expected[mask], atol=1e-5, rtol=0)
    shortest_prompt = min(len(p) for p in batch.prompt_ids)
    assert head_inputs == [packed.input_ids_B_T.shape[1] - shortest_prompt + 1]  # not every position
    assert head_inputs[0] < packed.input_ids_B_T.shape[1]


def test_sft_tokenization_starts_with_exactly_the_rl_prompt_ids(tiny_policy):
    tok = tiny_policy.tokenizer
    for prompt in PROMPTS:
        rl = format_prompt_ids(tok, prompt, "You are a helpful assistant.")
        sft, prompt_len = format_sft_ids(
            tok,
            prompt,
            "I think they are fine.",
            "You are a helpful assistant.",
            tiny_policy.end_of_turn_ids[0],
        )
        assert sft[:prompt_len] == rl and prompt_len == len(rl)
        assert sft[-1] in tiny_policy.end_of_turn_ids


def test_sampling_is_deterministic_for_a_seed(tiny_policy):
    _, a = _sample(tiny_policy, seed=5)
    _, b = _sample(tiny_policy, seed=5)
    _, c = _sample(tiny_policy, seed=6)
    assert [x.completion_ids for x in a] == [x.completion_ids for x in b] != [x.completion_ids for x in c]


def test_policy_without_trainable_parameters_is_refused(embedded_assets):
    with pytest.raises(PolicyError, match=r"none of model\.lora_target_modules"):
        load_policy(ModelConfig(lora_target_modules=["no_such_layer"]), 1.0, torch.device("cpu"), 0)


def test_sampling_settings_of_the_models_generation_config_do_not_reach_the_draw(tiny_policy):
    prompt_ids, plain = _sample(tiny_policy)
    # What a hub model's generation_config.json may carry, and transformers' generate would otherwise apply (an old
    # default top-k 50, nucleus, min-p, a repetition penalty, a minimum length, typical and epsilon sampling).
    for config in (tiny_policy.model.generation_config, tiny_policy.model.get_base_model().generation_config):
        config.update(
            top_k=5, top_p=0.3, min_p=0.2, repetition_penalty=3.0, min_new_tokens=12, typical_p=0.2, epsilon_cutoff=0.1
        )
    _, configured = _sample(tiny_policy)
    assert [c.completion_ids for c in configured] == [c.completion_ids for c in plain]
    stats = policy_gradient_step(
        tiny_policy, make_optimizer(tiny_policy, TrainingConfig()), _batch(prompt_ids, configured), TrainingConfig()
    )
    assert stats.first_ratio_abs_dev < 1e-5


def test_generate_makes_no_draw_of_its_own_even_where_the_models_config_asks_for_sampling(tiny_policy, monkeypatch):
    """The sampler draws each token; generate keeps it greedily. A second draw over the vocabulary, generate's
    softmax and multinomial, cost as much as the sampler's own on a CPU at Qwen3's vocabulary, and a hub model's
    generation_config.json (Qwen3's: do_sample true, temperature 0.7, top-k 20, top-p 0.8) must not bring it back."""
    import logging
    import warnings

    _, plain = _sample(tiny_policy)
    for config in (tiny_policy.model.generation_config, tiny_policy.model.get_base_model().generation_config):
        config.update(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    multinomial = torch.multinomial
    calls = []
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: calls.append(1) or multinomial(*a, **k))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, configured = _sample(tiny_policy)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert calls == []
    assert [c.completion_ids for c in configured] == [c.completion_ids for c in plain]
    noise = [str(w.message) for w in caught if "generat" in str(w.message).lower()]
    noise += [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert noise == []  # nothing said per call about sampling flags a greedy generate ignores


def test_sampler_refuses_tokens_it_did_not_draw(tiny_policy, monkeypatch):
    from redteam_grpo.core.rollouts import sampling

    def let_generate_draw(self, input_ids, scores):  # the scores of generate's own pipeline, not the one-hot
        sampling_step(self, input_ids, scores)
        return self.distribution.process(scores)

    sampling_step = sampling._StepwiseDraw.__call__
    monkeypatch.setattr(sampling._StepwiseDraw, "__call__", let_generate_draw)
    with pytest.raises(sampling.SamplingError, match="kept other tokens than the sampler drew"):
        _sample(tiny_policy)


def test_generate_keeps_no_per_step_vocabulary_tensors(tiny_policy, monkeypatch):
    seen = []
    generate = tiny_policy.model.generate
    monkeypatch.setattr(
        tiny_policy.model, "generate", lambda **kw: seen.append(kw["generation_config"]) or generate(**kw)
    )
    _sample(tiny_policy)
    assert seen and all(not (c.return_dict_in_generate and (c.output_scores or c.output_logits)) for c in seen)


def test_lora_dropout_does_not_make_the_first_ratio_noisy(embedded_assets):
    policy = load_policy(ModelConfig(lora_dropout=0.3), 1.0, torch.device("cpu"), 0)
    # LoRA B is 0 at init, where dropout cannot show: train once so the adapter path carries signal.
    cfg = TrainingConfig(learning_rate=1e-2)
    optimizer = make_optimizer(policy, cfg)
    prompt_ids, completions = _sample(policy)
    policy_gradient_step(policy, optimizer, _batch(prompt_ids, completions), cfg)
    prompt_ids, completions = _sample(policy, seed=1)
    stats = policy_gradient_step(policy, optimizer, _batch(prompt_ids, completions), cfg)
    assert stats.first_ratio_abs_dev < 1e-5


def test_a_policy_left_in_training_mode_is_refused(tiny_policy):
    tiny_policy.model.train()  # dropout on: logprobs of the same tokens would differ between forwards
    with pytest.raises(PolicyError, match="training mode"):
        _sample(tiny_policy)


def test_trainer_replays_token_suppression_of_the_sampler(tiny_policy):
    from redteam_grpo.core.tokens.logprobs import SamplingDistribution

    # Suppress a large share of the vocabulary: a trainer that ignored suppression would be far from ratio 1.
    vocab = len(tiny_policy.tokenizer)
    tiny_policy.distribution = SamplingDistribution(0.7, tuple(range(vocab // 4, vocab // 2)))
    prompt_ids, completions = _sample(tiny_policy)
    assert not any(vocab // 4 <= t < vocab // 2 for c in completions for t in c.completion_ids)
    stats = policy_gradient_step(
        tiny_policy, make_optimizer(tiny_policy, TrainingConfig()), _batch(prompt_ids, completions), TrainingConfig()
    )
    assert stats.first_ratio_abs_dev < 1e-5


def test_a_ratio_that_is_not_one_on_the_first_update_refuses_the_step(tiny_policy):
    from redteam_grpo.core.training.train import RatioCheckError

    prompt_ids, completions = _sample(tiny_policy)
    batch = _batch(prompt_ids, completions)
    stale = TrainBatch(  # logprobs that are not those of the sampled distribution (e.g. read from a wrong column)
        batch.prompt_ids,
        batch.completion_ids,
        [[0.0] * len(x) for x in batch.sample_logprobs],
        batch.advantages,
        batch.group_ids,
    )
    before = {k: v.clone() for k, v in tiny_policy.adapter_state().items()}
    with pytest.raises(RatioCheckError, match="does not see the distribution"):
        policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, TrainingConfig()), stale, TrainingConfig())
    after = tiny_policy.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_check_trainable_refuses_a_policy_whose_adapter_is_frozen(tiny_policy):
    from redteam_grpo.core.models.policy import check_trainable

    for parameter in tiny_policy.model.parameters():
        parameter.requires_grad_(False)
    with pytest.raises(PolicyError, match="no trainable parameters"):
        check_trainable(tiny_policy)


def test_check_trainable_refuses_trainable_weights_outside_the_adapter(tiny_policy):
    from redteam_grpo.core.models.policy import check_trainable

    tiny_policy.model.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(PolicyError, match="outside the LoRA adapter"):
        check_trainable(tiny_policy)


def test_bfloat16_weights_sample_and_train_with_float32_logprob_math(embedded_assets):
    policy = load_policy(ModelConfig(dtype="bfloat16"), 1.0, torch.device("cpu"), 0)
    assert next(policy.model.get_base_model().parameters()).dtype == torch.bfloat16
    prompt_ids, completions = _sample(policy, max_new_tokens=24)
    recorded = torch.tensor([lp for c in completions for lp in c.sample_logprobs])
    # float32 math: most logprobs are not bfloat16 values (8 significant bits) rounded back
    assert (recorded.to(torch.bfloat16).float() != recorded).float().mean() > 0.9
    cfg = TrainingConfig()
    stats = policy_gradient_step(policy, make_optimizer(policy, cfg), _batch(prompt_ids, completions), cfg)
    assert stats.sampler_kl < stats.sampler_kl_tolerance / 3  # the cached decode and full forward agree
    assert math.isfinite(stats.grad_norm) and stats.grad_norm > 0
