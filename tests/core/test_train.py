"""`policy_gradient_step` on the tiny policy: micro-batching, every loss and normalisation, dynamic sampling and
truncated importance sampling, each checked against the gradient computed here from `core/training/loss.py` directly."""

import dataclasses
import math

import pytest
import torch

from redteam_grpo.core.config import TrainingConfig
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import completion_logits
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.logprobs import token_logprobs
from redteam_grpo.core.training.loss import gspo_loss, importance_sampling_loss, ppo_clip_loss
from redteam_grpo.core.training.train import (
    NonFiniteUpdateError,
    RatioCheckError,
    TrainBatch,
    UpdateStats,
    informative_rows,
    make_optimizer,
    policy_gradient_step,
)

PROMPTS = ["Hi", "Describe my coworker.", "What do you think of your neighbours?", "Tell me a story."]
GROUP_SIZE = 3
MAX_NEW_TOKENS = 12


def _perturb_adapter(policy, scale=0.05):
    """LoRA B starts at 0, where A gets no gradient: give the adapter a value so every parameter is exercised."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def _batch(policy, advantages=None, sample_logprobs=None) -> TrainBatch:
    prompt_ids = [format_prompt_ids(policy.tokenizer, p, "You are a helpful assistant.") for p in PROMPTS]
    completions = sample_completions(policy, prompt_ids, GROUP_SIZE, MAX_NEW_TOKENS, batch_size=16, seed=0)
    return TrainBatch(
        prompt_ids=[prompt_ids[c.prompt_index] for c in completions],
        completion_ids=[c.completion_ids for c in completions],
        sample_logprobs=sample_logprobs or [c.sample_logprobs for c in completions],
        advantages=advantages or [(-1.0) ** i * (1 + i % 4) / 4 for i in range(len(completions))],
        group_ids=[f"prompt-{c.prompt_index}" for c in completions],
        max_new_tokens=MAX_NEW_TOKENS,
    )


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _assert_same_gradient(actual, expected, rel=1e-4, may_be_zero=False):
    actual, expected = _flat(actual), _flat(expected)
    assert may_be_zero or expected.norm() > 0
    assert (actual - expected).norm() <= rel * expected.norm(), float((actual - expected).norm() / expected.norm())


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps, at every step, the parameters it is about to change and the gradient it was given."""

    def __init__(self, params, lr):
        self.tracked = list(params)
        super().__init__(self.tracked, lr=lr)
        self.values: list[list[torch.Tensor]] = []
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.values.append([p.detach().clone() for p in self.tracked])
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.tracked])
        return super().step(closure)


def _weights(mask, normalization, n_tokens, n_sequences):
    """The normalisations written out per token, independently of `token_weights`."""
    lengths = mask.sum(-1, keepdim=True).float()
    per_token = {
        "token": torch.full_like(lengths, 1 / n_tokens),
        "sequence": 1 / (n_sequences * lengths),
        "constant": torch.full_like(lengths, 1 / (n_sequences * MAX_NEW_TOKENS)),
    }[normalization]
    return mask.float() * per_token


def _replayed_gradient(policy, params, values, batch, loss_fn, normalization, old_fn, is_weights_fn=None):
    """The gradient of the whole batch at `values`, in one forward, with the loss called directly."""
    with torch.no_grad():
        for parameter, value in zip(params, values, strict=True):
            parameter.copy_(value)
    for parameter in params:
        parameter.grad = None
    logits, ids, mask = completion_logits(policy, batch.prompt_ids, batch.completion_ids)
    logprobs = token_logprobs(policy.distribution.logprobs(logits), ids)
    old = old_fn(logprobs, mask)
    weights = _weights(mask, normalization, int(mask.sum()), mask.shape[0])
    if is_weights_fn is not None:
        weights = weights * is_weights_fn(mask)
    loss, stats = loss_fn(logprobs, old, torch.tensor(batch.advantages), weights, mask)
    loss.backward()
    return [p.grad.detach().clone() for p in params], logprobs.detach(), mask, stats


def _sample_logprobs(batch, mask):
    out = torch.zeros(mask.shape)
    for b, row in enumerate(batch.sample_logprobs):
        out[b, : len(row)] = torch.tensor(row)
    return out


LOSSES = {
    "importance_sampling": importance_sampling_loss,
    "ppo_clip": lambda *a: ppo_clip_loss(*a, epsilon_low=0.05, epsilon_high=0.1),
    "gspo": lambda *a: gspo_loss(*a, epsilon_low=3e-4, epsilon_high=4e-4),
}
CLIP_SETTINGS = {
    "importance_sampling": {},
    "ppo_clip": {"ppo_clip_epsilon_low": 0.05, "ppo_clip_epsilon_high": 0.1},
    "gspo": {},
}


def test_update_stats_has_exactly_the_documented_float_fields(tiny_policy):
    names = [
        "loss",
        "sampler_kl",
        "sampler_kl_tolerance",
        "sampler_kl_first_token",
        "sampler_kl_first_token_bound",
        "sampler_kl_last_token",
        "sampler_kl_last_token_bound",
        "sampler_kl_turn_boundary",
        "sampler_kl_turn_boundary_bound",
        "sampler_kl_sequence",
        "sampler_kl_sequence_bound",
        "varentropy",
        "ratio_mean",
        "ratio_std",
        "ratio_max",
        "first_ratio_abs_dev",
        "clip_fraction",
        "grad_norm",
        "entropy",
        "n_tokens",
        "n_sequences",
        "n_dropped_groups",
        "last_ratio_std",
        "logprob_mismatch_mean",
        "logprob_mismatch_max",
        "logprob_mismatch_share",
        "correction_token_share",
        "correction_sequence_share",
        "staleness",
    ]
    assert [f.name for f in dataclasses.fields(UpdateStats)] == names
    batch = _batch(tiny_policy)
    cfg = TrainingConfig(updates_per_batch=2, learning_rate=1e-2)
    stats = dataclasses.asdict(policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg))
    assert all(type(v) is float for v in stats.values()), stats
    assert stats["n_sequences"] == len(batch.completion_ids)
    assert stats["n_tokens"] == sum(len(c) for c in batch.completion_ids)
    assert stats["n_dropped_groups"] == 0.0 and stats["entropy"] > 0 and stats["grad_norm"] > 0
    assert stats["last_ratio_std"] > 1e-4  # the ratio moved on the second update


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo_clip", "gspo"])
@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_micro_batches_of_one_give_the_gradient_of_the_whole_batch(tiny_policy, normalization, loss):
    _perturb_adapter(tiny_policy)
    batch = _batch(tiny_policy)
    params = tiny_policy.trainable_parameters()
    grads = []
    for micro_batch_size in (1, len(batch.completion_ids)):
        cfg = TrainingConfig(
            loss=loss,
            loss_normalization=normalization,
            micro_batch_size=micro_batch_size,
            grad_clip=None,
            **CLIP_SETTINGS[loss],
        )
        # lr 0: the parameters stay put and the accumulated gradient stays in .grad after the step
        policy_gradient_step(tiny_policy, torch.optim.SGD(params, lr=0.0), batch, cfg)
        grads.append([p.grad.detach().clone() for p in params])
    _assert_same_gradient(grads[0], grads[1], rel=1e-5)


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_micro_batches_by_tokens_and_gradient_checkpointing_keep_the_gradient_and_compute_less(
    tiny_policy, normalization, monkeypatch
):
    from redteam_grpo.core.training import train

    _perturb_adapter(tiny_policy)
    batch = _batch(tiny_policy)
    params = tiny_policy.trainable_parameters()
    longest = max(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True))
    padded_tokens = []
    forward = train.span_logits

    def counting_forward(policy, sequences, spans):
        padded_tokens.append(len(sequences) * max(len(s) for s in sequences))
        return forward(policy, sequences, spans)

    monkeypatch.setattr(train, "span_logits", counting_forward)
    checkpointed = _counted_checkpoints(monkeypatch)
    grads, tokens = [], []
    settings = [{}, {"micro_batch_tokens": 2 * longest}, {"micro_batch_size": 4, "gradient_checkpointing": True}]
    for setting in settings:
        padded_tokens.clear()
        cfg = TrainingConfig(loss_normalization=normalization, grad_clip=None, **setting)
        policy_gradient_step(tiny_policy, torch.optim.SGD(params, lr=0.0), batch, cfg)
        grads.append([p.grad.detach().clone() for p in params])
        tokens.append(sum(padded_tokens))
    _assert_same_gradient(grads[1], grads[0], rel=1e-5)
    _assert_same_gradient(grads[2], grads[0], rel=1e-5)
    assert tokens[1] < tokens[0]  # grouped by length: less padding than one micro-batch padded to the longest
    _assert_every_layer_checkpointed_once_per_micro_batch(tiny_policy, checkpointed)


class _Absent:
    """A class attribute that reads as missing (hasattr is False), as a method a transformers version lacks."""

    def __get__(self, obj, owner):
        raise AttributeError("absent in this transformers version")


def test_gradient_checkpointing_works_with_the_api_transformers_5_17_has(tiny_policy, monkeypatch):
    """transformers 5.17 (a GPU image's) has only gradient_checkpointing_enable/disable: the rename to
    activation_checkpointing_* came later, and calling the new name there failed the first checkpointed step."""
    base_class = type(tiny_policy.model.get_base_model())
    for name in ("activation_checkpointing_enable", "activation_checkpointing_disable"):
        monkeypatch.setattr(base_class, name, _Absent())
    calls = []

    def old_enable(self, gradient_checkpointing_kwargs=None):  # 5.17's name and signature, today's implementation
        calls.append(("enable", gradient_checkpointing_kwargs))
        self._activation_checkpointing_enable(gradient_checkpointing_kwargs)

    def old_disable(self):
        calls.append(("disable", None))
        self._activation_checkpointing_disable()

    monkeypatch.setattr(base_class, "gradient_checkpointing_enable", old_enable)
    monkeypatch.setattr(base_class, "gradient_checkpointing_disable", old_disable)
    checkpointed = _counted_checkpoints(monkeypatch)
    _perturb_adapter(tiny_policy)
    cfg = TrainingConfig(micro_batch_size=4, gradient_checkpointing=True, grad_clip=None)
    params = tiny_policy.trainable_parameters()
    policy_gradient_step(tiny_policy, torch.optim.SGD(params, lr=0.0), _batch(tiny_policy), cfg)
    assert calls == [("enable", {"use_reentrant": False}), ("disable", None)]
    _assert_every_layer_checkpointed_once_per_micro_batch(tiny_policy, checkpointed)


def _counted_checkpoints(monkeypatch) -> list:
    """A list that grows by one each time transformers checkpoints a layer (for the rest of the test)."""
    import transformers.modeling_utils as modeling_utils

    checkpointed = []
    checkpoint = modeling_utils.checkpoint
    monkeypatch.setattr(modeling_utils, "checkpoint", lambda *a, **k: checkpointed.append(1) or checkpoint(*a, **k))
    return checkpointed


def _assert_every_layer_checkpointed_once_per_micro_batch(tiny_policy, checkpointed: list) -> None:
    layers = tiny_policy.model.get_base_model().config.num_hidden_layers
    assert len(checkpointed) == layers * 3  # every layer of each of the three micro-batches of 4 was checkpointed
    assert not tiny_policy.model.training and not any(m.training for m in tiny_policy.model.modules())


def test_micro_batches_cover_every_row_once_within_their_caps():
    from redteam_grpo.core.training.batching import micro_batches

    lengths = [(7 * i) % 50 + 1 for i in range(40)]
    rows = [i for i in range(40) if i % 5]
    batches = micro_batches(rows, lengths, max_sequences=6, max_tokens=90)
    assert sorted(r for b in batches for r in b) == rows
    for b in batches:
        assert len(b) <= 6 and (len(b) == 1 or len(b) * max(lengths[r] for r in b) <= 90)
    assert micro_batches(rows, lengths, max_sequences=6) == [rows[s : s + 6] for s in range(0, len(rows), 6)]


@pytest.mark.parametrize(
    ("loss", "normalization", "learning_rate"),
    [
        ("ppo_clip", "sequence", 2e-2),
        ("ppo_clip", "token", 2e-2),
        ("gspo", "sequence", 1e-4),  # sequence ratios move past 1 +- 4e-4 with far smaller steps
        ("importance_sampling", "constant", 2e-2),
    ],
)
def test_every_update_has_the_gradient_of_the_configured_loss_and_normalisation(
    tiny_policy, loss, normalization, learning_rate
):
    _perturb_adapter(tiny_policy)
    batch = _batch(tiny_policy)
    cfg = TrainingConfig(
        loss=loss,
        loss_normalization=normalization,
        updates_per_batch=3,
        micro_batch_size=5,
        grad_clip=None,
        **CLIP_SETTINGS[loss],
    )
    params = tiny_policy.trainable_parameters()
    optimizer = RecordingAdamW(params, lr=learning_rate)
    stats = policy_gradient_step(tiny_policy, optimizer, batch, cfg)
    assert len(optimizer.grads) == 3
    advantages = torch.tensor(batch.advantages)
    clipped_later = 0
    for update, (values, recorded) in enumerate(zip(optimizer.values, optimizer.grads, strict=True)):
        expected, logprobs, mask, replay = _replayed_gradient(
            tiny_policy, params, values, batch, LOSSES[loss], normalization, lambda lp, m: _sample_logprobs(batch, m)
        )
        # every token clipped (GSPO's narrow range, later updates) is a gradient of exactly 0
        _assert_same_gradient(recorded, expected, may_be_zero=update > 0)
        if update == 0:
            assert replay.n_clipped == 0 and stats.clip_fraction == 0.0  # ratio 1: nothing to clip yet
        else:
            clipped_later += replay.n_clipped
        if loss == "ppo_clip" and update > 0:
            # the ratios moved into the band that only clip-higher leaves unclipped, and past it
            ratio = torch.exp(logprobs - _sample_logprobs(batch, mask))
            positive = mask & (advantages > 0).unsqueeze(-1)
            assert ((ratio > 1.05) & (ratio < 1.1) & positive).any()
            assert ((ratio > 1.1) & positive).any()
    if loss != "importance_sampling":
        assert clipped_later > 0  # clipping really happened on the later updates
    assert stats.last_ratio_std > 1e-3


def test_dynamic_sampling_drops_the_groups_whose_advantages_are_all_zero(tiny_policy):
    assert informative_rows(["a", "a", "b", "b", "c"], [0.5, -0.5, 0.0, 0.0, 0.0]) == ([0, 1], 2)
    assert informative_rows(["a", "b", "a"], [0.0, 0.0, 1.0]) == ([0, 2], 1)

    _perturb_adapter(tiny_policy)
    # prompt 1's group has advantages all 0: it adds no gradient, only tokens to the normaliser
    advantages = [0.0 if i // GROUP_SIZE == 1 else (-1.0) ** i for i in range(len(PROMPTS) * GROUP_SIZE)]
    batch = _batch(tiny_policy, advantages=advantages)
    kept = [i for i in range(len(advantages)) if i // GROUP_SIZE != 1]
    without = dataclasses.replace(
        batch,
        **{f: [getattr(batch, f)[i] for i in kept] for f in ("prompt_ids", "completion_ids", "sample_logprobs")},
        advantages=[advantages[i] for i in kept],
        group_ids=[batch.group_ids[i] for i in kept],
    )
    params = tiny_policy.trainable_parameters()

    def gradient(b, dynamic):
        cfg = TrainingConfig(dynamic_sampling=dynamic, grad_clip=None, micro_batch_size=4)
        stats = policy_gradient_step(tiny_policy, torch.optim.SGD(params, lr=0.0), b, cfg)
        return [p.grad.detach().clone() for p in params], stats

    dropped, stats = gradient(batch, dynamic=True)
    removed, _ = gradient(without, dynamic=False)
    diluted, diluted_stats = gradient(batch, dynamic=False)
    assert stats.n_dropped_groups == 1.0 and stats.n_sequences == len(kept)
    assert stats.n_tokens == sum(len(c) for c in without.completion_ids)
    _assert_same_gradient(dropped, removed, rel=1e-5)
    # kept, the group only dilutes: the same direction, scaled by kept tokens / all tokens
    _assert_same_gradient([g * stats.n_tokens / diluted_stats.n_tokens for g in dropped], diluted, rel=1e-5)
    assert diluted_stats.n_dropped_groups == 0.0


@pytest.mark.parametrize("correction", ["token_truncate", "sequence_truncate", "sequence_mask", "icepop"])
def test_a_mismatch_correction_changes_nothing_when_sampler_and_trainer_agree(tiny_policy, correction):
    _perturb_adapter(tiny_policy)
    batch = _batch(tiny_policy)
    start = {k: v.clone() for k, v in tiny_policy.adapter_state().items()}
    results = []
    for method in ("none", correction):
        tiny_policy.load_adapter_state(start)
        cfg = TrainingConfig(loss="ppo_clip", mismatch_correction=method, updates_per_batch=3, learning_rate=1e-2)
        stats = policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg)
        results.append((stats, tiny_policy.adapter_state()))
    (plain, plain_state), (truncated, truncated_state) = results
    for key in plain_state:
        torch.testing.assert_close(truncated_state[key], plain_state[key], rtol=1e-4, atol=1e-6)
    assert truncated.last_ratio_std == pytest.approx(plain.last_ratio_std, rel=1e-3)
    assert truncated.first_ratio_abs_dev < 1e-5 and truncated.sampler_kl == pytest.approx(0.0, abs=1e-8)
    assert truncated.correction_token_share == 0.0 and math.isnan(plain.correction_token_share)


def test_truncated_is_with_another_sampler_keeps_the_first_trainer_logprobs_and_caps_the_weight(tiny_policy):
    _perturb_adapter(tiny_policy)
    honest = _batch(tiny_policy)
    # Another engine: its logprobs differ from the trainer's by +-0.3 (ratios trainer / sampler 0.74 and 1.35).
    shift = [[0.3 * (-1) ** (b + t) for t in range(len(row))] for b, row in enumerate(honest.sample_logprobs)]
    sampler = [
        [lp + s for lp, s in zip(row, d, strict=True)] for row, d in zip(honest.sample_logprobs, shift, strict=True)
    ]
    batch = dataclasses.replace(honest, sample_logprobs=sampler)
    cap = 1.2
    cfg = TrainingConfig(
        mismatch_correction="token_truncate",
        mismatch_ratio_high=cap,
        updates_per_batch=2,
        micro_batch_size=5,
        grad_clip=None,
        first_update_kl_tolerance=1.0,
    )
    params = tiny_policy.trainable_parameters()
    optimizer = RecordingAdamW(params, lr=1e-2)
    stats = policy_gradient_step(tiny_policy, optimizer, batch, cfg)
    # the first-update statistics compare trainer and sampler: mean |exp(-+0.3) - 1|
    assert stats.first_ratio_abs_dev == pytest.approx((math.exp(0.3) - 1 + 1 - math.exp(-0.3)) / 2, rel=0.05)
    assert stats.sampler_kl > 0.01

    trainer_old = {}

    def old_fn(logprobs, mask):  # the trainer at the sampling weights: the first forward, kept
        trainer_old.setdefault("lp", logprobs.detach())
        return trainer_old["lp"]

    def is_weights(mask):  # min(p_trainer_old / p_sampler, cap), computed here by hand
        ratio = torch.exp(trainer_old["lp"] - _sample_logprobs(batch, mask))
        return torch.where(mask, ratio.clamp(max=cap), torch.zeros_like(ratio))

    for values, recorded in zip(optimizer.values, optimizer.grads, strict=True):
        expected, _, mask, _ = _replayed_gradient(
            tiny_policy, params, values, batch, importance_sampling_loss, "token", old_fn, is_weights
        )
        _assert_same_gradient(recorded, expected)
    ratio = torch.exp(trainer_old["lp"] - _sample_logprobs(batch, mask))
    assert ((ratio > cap) & mask).any() and ((ratio < 1.0) & mask).any()  # some weights capped, some below 1
    assert stats.correction_token_share == pytest.approx(float(((ratio > cap) & mask).sum() / mask.sum()))
    assert stats.last_ratio_std > 1e-3  # the later ratio is against the kept logprobs, not recomputed ones


def test_a_batch_drawn_one_update_ago_trains_decoupled_against_its_behaviour_logprobs_without_the_check(tiny_policy):
    # Bug class behaviour-logprobs-replaced (docs/bug-classes.md): one step off-policy (training.max_staleness=1).
    # The trainer is one update ahead of the weights that drew the batch; the ratio is against the trainer's own
    # logprobs at the step and each token weighted by min(p_trainer / p_behaviour, 2), p_behaviour the stored
    # sampling logprobs. Were the trainer's logprobs put in their place, every weight would be 1, silently.
    _perturb_adapter(tiny_policy)
    batch = dataclasses.replace(_batch(tiny_policy), sampler="vllm")  # drawn by these weights
    cfg = TrainingConfig(grad_clip=None, learning_rate=3e-2, micro_batch_size=5)
    params = tiny_policy.trainable_parameters()
    policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg)  # the update the sampler missed
    before = [p.detach().clone() for p in params]
    # held to the first-update check as if fresh, it is refused: the sampler's weights are not the trainer's
    with pytest.raises(RatioCheckError):
        policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg)
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))

    stale = dataclasses.replace(batch, staleness=1)
    optimizer = RecordingAdamW(params, lr=1e-2)
    stats = policy_gradient_step(tiny_policy, optimizer, stale, cfg)
    assert stats.staleness == 1.0
    assert stats.sampler_kl > 1e-5  # KL(behaviour || current), reported: one update of 3e-2 apart

    trainer_old = {}

    def old_fn(logprobs, mask):
        trainer_old.setdefault("lp", logprobs.detach())
        return trainer_old["lp"]

    def is_weights(mask):  # min(p_trainer / p_behaviour, 2): token_truncate, the default for another engine
        ratio = torch.exp(trainer_old["lp"] - _sample_logprobs(stale, mask))
        return torch.where(mask, ratio.clamp(max=2.0), torch.zeros_like(ratio))

    (values,), (recorded,) = optimizer.values, optimizer.grads
    expected, _, mask, _ = _replayed_gradient(
        tiny_policy, params, values, stale, importance_sampling_loss, "token", old_fn, is_weights
    )
    _assert_same_gradient(recorded, expected)
    factors = torch.exp(trainer_old["lp"] - _sample_logprobs(stale, mask))[mask]
    assert (factors - 1).abs().mean() > 1e-3  # the weights are not 1: the test tells the two apart

    with pytest.raises(ValueError, match="needs a mismatch correction"):
        no_correction = TrainingConfig(mismatch_correction="none")
        policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, no_correction), stale, no_correction)


def test_constant_normalisation_needs_the_samplers_max_new_tokens(tiny_policy):
    batch = dataclasses.replace(_batch(tiny_policy), max_new_tokens=None)
    cfg = TrainingConfig(loss_normalization="constant")
    with pytest.raises(ValueError, match="max_new_tokens"):
        policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg)


def test_a_batch_with_nothing_to_learn_takes_no_step(tiny_policy):
    batch = _batch(tiny_policy, advantages=[0.0] * (len(PROMPTS) * GROUP_SIZE))
    before = {k: v.clone() for k, v in tiny_policy.adapter_state().items()}
    cfg = TrainingConfig(dynamic_sampling=True)
    stats = policy_gradient_step(tiny_policy, make_optimizer(tiny_policy, cfg), batch, cfg)
    assert stats.n_dropped_groups == len(PROMPTS) and stats.n_sequences == 0 and stats.n_tokens == 0
    assert math.isnan(stats.ratio_mean) and stats.loss == 0.0
    after = tiny_policy.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("how", ["learning_rate", "loss"])
def test_an_update_that_would_make_the_weights_non_finite_stops_with_the_way_out(tiny_policy, how):
    """A learning rate of inf (the config refuses it; an optimizer can still be given one) or a NaN advantage:
    the step is refused naming the update and the way out, before any weight could be checkpointed."""
    cfg = TrainingConfig(learning_rate=1e-2)
    optimizer = make_optimizer(tiny_policy, cfg)
    batch = _batch(tiny_policy)
    if how == "learning_rate":
        for group in optimizer.param_groups:
            group["lr"] = math.inf
    else:
        batch = dataclasses.replace(batch, advantages=[math.nan] * len(batch.advantages))
    before = {k: v.clone() for k, v in tiny_policy.adapter_state().items()}
    try:
        with pytest.raises(NonFiniteUpdateError, match=r"update 0 of the batch .*lower training\.learning_rate"):
            policy_gradient_step(tiny_policy, optimizer, batch, cfg)
        if how == "loss":  # refused before the step: the weights are untouched
            assert all(torch.equal(before[k], v) for k, v in tiny_policy.adapter_state().items())
    finally:
        tiny_policy.load_adapter_state(before)
