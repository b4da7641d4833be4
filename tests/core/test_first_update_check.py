"""The first-update check tells rounding noise from misalignment with margins, on models whose distributions are as
peaked as a trained model's and as deep or as wide as real ones: a correct bfloat16 run's statistic is at most a third
of its bound at every gate, and each way of training on other tokens, ids or distributions than were sampled is at
least 3x its bound at the gate made for it, and refused. The misalignments are put into the batch or the trainer's
distribution here, not into the code: each is one of the misalignment bug classes of docs/bug-classes.md, as it would
reach the update.

Models: a trained deep model (the embedded recipe at 8 layers, tests/deep_model.py) and a random model of Qwen3-4B's
width and vocabulary with Qwen3's real tokenizer (2 layers; logits of standard deviation 5), at T in {0.7, 1.0} (the
wide model at 0.7: see CASES). The real CPU engine: tests/e2e/test_vllm_engine.py. Each case prints its statistic /
bound per gate (`-s`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from redteam_grpo.core.config import ModelConfig, TrainingConfig
from redteam_grpo.core.models.policy import load_policy
from redteam_grpo.core.tokens.logprobs import SamplingDistribution
from redteam_grpo.core.training.train import (
    KL_BOUND_WIDTH_COEF,
    RatioCheckError,
    TrainBatch,
    first_update_tolerance,
    make_optimizer,
    rounding_noise_scale,
)
from redteam_grpo.core.training.train import policy_gradient_step as step
from tests.first_update import (
    check_margins,
    check_moved,
    check_refused,
    drop_the_first_prompt_id,
    read_the_wrong_column,
    record_the_last_logprob_as_zero,
    sampled_batch,
    score_the_first_token_in_the_wrong_context,
    shift_logprobs_one_token_late,
    trainer_with_temperature,
)
from tests.real_width import save_real_width_model

# -- the models --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_deep_folder(embedded_assets):
    from tests.deep_model import trained_deep_policy

    return trained_deep_policy()


@pytest.fixture(scope="module")
def real_width_folder(tmp_path_factory, embedded_assets):
    return save_real_width_model(tmp_path_factory.mktemp("qwen3-4b-width"))


def _policy(folder, temperature, suppress_quarter=False):
    policy = load_policy(ModelConfig(policy=str(folder), dtype="bfloat16"), temperature, torch.device("cpu"), 0)
    if suppress_quarter:  # a sampler that forbids a quarter of the vocabulary
        vocab = len(policy.tokenizer)
        suppressed = tuple(sorted({*policy.distribution.suppressed_ids, *range(vocab // 4, vocab // 2)}))
        policy.distribution = SamplingDistribution(temperature, suppressed)
    return policy


# The wide model at T = 0.7 only: a step at Qwen3-4B's width and vocabulary costs minutes on a CPU without AVX-512
# (its bfloat16 head backward), every misalignment case one step more. Its T = 1.0 and 256-token-row cases passed
# with the margins asserted here when they were last run, and are left out to keep the suite's time; both
# temperatures and the long rows stay covered on the trained deep model.
CASES = [("trained_deep_folder", 0.7), ("trained_deep_folder", 1.0), ("real_width_folder", 0.7)]


@pytest.mark.parametrize(("model", "temperature"), CASES)
def test_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it(request, model, temperature):
    folder = request.getfixturevalue(model)
    cfg = TrainingConfig()
    label = f"{model.removesuffix('_folder')} T={temperature}"
    policy = _policy(folder, temperature)
    wide = model == "real_width_folder"
    # The wide model's margins are wide, so it samples 8 rows of 16 tokens, a third of the deep model's tokens and of
    # its minutes a step. Measured on an Intel Xeon: with 16 rows of 24, noise at most 0.093 of a bound, a lost first
    # prompt id 193x, the first token's context 1.9e12x (464 s); with 8 rows of 16, 0.048, 284x and 6.5e10x (161 s).
    batch = sampled_batch(policy, max_new_tokens=16, samples=2) if wide else sampled_batch(policy)
    misses: list = []
    check_margins(policy, batch, cfg, label, misses)
    other_temperature = 1.0 if temperature != 1.0 else 0.7
    weak = [] if model == "real_width_folder" else [drop_the_first_prompt_id]
    for misalign in weak:
        # On the trained deep model a lost first prompt id moves the distribution by only 7-20x the rounding noise
        # (the model is built on each machine: KL 1.0e-3 against 5.1e-5 at T = 0.7 and 2.1e-4 against 1.1e-5 at T = 1
        # on an Intel Xeon, 1.05e-4 against 1.39e-5 at T = 0.7 on an AMD EPYC), while the noise per unit of the bound
        # differs 6x between the two temperatures: no bound from the distribution is within 1/3 of both. It is real
        # (asserted here: NOISE_MARGIN = 3x the correct run's KL, 2.5x below the least measured) and caught exactly
        # where it happens instead: the ids are checked (tests/core/test_policy_invariants.py: the training forward
        # sees exactly the ids the sampler fed and drew).
        check_moved(policy, batch, misalign, label)
    # Each case is a full step: on the wide model (minutes a step without AVX-512) those whose gate the deep model
    # checks at both temperatures are left out (shifted logprobs, another logprob column, the first token's context,
    # an unreplayed temperature); the lost first prompt id, which the deep model's distribution cannot hold, stays.
    for misalign, gates in [
        *([] if wide else [(shift_logprobs_one_token_late, ("token", "sequence"))]),
        *([(drop_the_first_prompt_id, ("token", "sequence"))] if not weak else []),
        *([] if wide else [(read_the_wrong_column, ("token", "sequence"))]),
        *([] if wide else [(score_the_first_token_in_the_wrong_context, ("first_token",))]),
        *([] if wide else [(trainer_with_temperature(other_temperature), ("token", "sequence"))]),
    ]:
        check_refused(policy, misalign(policy, batch), cfg, f"{label} {misalign.__name__}", gates, misses)
        policy.distribution = batch.sampled_with
    assert not misses, misses


def test_with_a_quarter_of_the_vocabulary_suppressed_noise_stays_a_third_and_a_misalignment_is_refused(
    trained_deep_folder,
):
    """A sampler that forbids a quarter of the vocabulary: the bound is the suppressed distribution's, a correct run
    stays within a third of it and logprobs shifted by one are refused at three times it. A lost first prompt id
    moves the KL by more than NOISE_MARGIN x the correct run's; at the gates it measured 2.0x its bound on an AMD EPYC
    (and above 3x on an Intel Xeon): like the unsuppressed case, it is held by the exact id check."""
    cfg = TrainingConfig()
    policy = _policy(trained_deep_folder, 0.7, suppress_quarter=True)
    batch = sampled_batch(policy)
    label = "trained_deep T=0.7 quarter suppressed"
    check_margins(policy, batch, cfg, label)
    check_refused(policy, shift_logprobs_one_token_late(policy, batch), cfg, f"{label} shifted", ("token", "sequence"))
    check_moved(policy, batch, drop_the_first_prompt_id, label)


@pytest.mark.parametrize("model", ["trained_deep_folder"])
def test_a_last_logprob_recorded_as_zero_in_long_rows_is_refused_at_the_last_token(request, model):
    """The per-token mean divides a once-per-row error by the row's length: the last-token and sequence gates do
    not. 256-token rows (the trained model ends some rows earlier, at its EOS: their last token is the EOS)."""
    folder = request.getfixturevalue(model)
    cfg = TrainingConfig()
    policy = _policy(folder, 1.0)
    batch = sampled_batch(policy, max_new_tokens=256, samples=2)
    label = f"{model.removesuffix('_folder')} T=1.0, 256-token rows"
    check_margins(policy, batch, cfg, label)
    misaligned = record_the_last_logprob_as_zero(policy, batch)
    check_refused(policy, misaligned, cfg, f"{label} record_the_last_logprob_as_zero", ("last_token",))
    print(f"{label}: mean trained tokens per row {sum(map(len, batch.completion_ids)) / len(batch.completion_ids):.0f}")


def test_a_turn_boundary_error_is_refused_at_the_turn_boundary_gate(trained_deep_folder):
    """A dialogue row (two trained turns with the other speaker's tokens between) whose second turn's first token
    carries another token's logprob: one token in the row, held against the turn boundaries' bound."""
    cfg = TrainingConfig()
    policy = _policy(trained_deep_folder, 1.0)
    single = sampled_batch(policy)
    keep = [i for i, c in enumerate(single.completion_ids) if len(c) >= 12]
    assert len(keep) >= 4
    spans, logprobs = [], []
    for i in keep:
        start, n = len(single.prompt_ids[i]), len(single.completion_ids[i])
        middle = n // 2
        spans.append([(start, start + middle - 2), (start + middle, start + n)])
        row = single.sample_logprobs[i]
        logprobs.append([*row[: middle - 2], *row[middle:]])
    dialogue = TrainBatch(
        prompt_ids=[single.prompt_ids[i] for i in keep],
        completion_ids=[single.completion_ids[i] for i in keep],
        sample_logprobs=logprobs,
        advantages=[single.advantages[i] for i in keep],
        group_ids=[single.group_ids[i] for i in keep],
        spans=spans,
        sampled_with=single.sampled_with,
    )
    noise = check_margins(policy, dialogue, cfg, "trained_deep dialogue")
    assert not math.isnan(noise["turn_boundary"])
    swapped = []  # the second turn's first logprob is the first turn's last (an off-by-one at the turn's start)
    for (first, _), row in zip(spans, logprobs, strict=True):
        at = first[1] - first[0]
        swapped.append([*row[:at], row[at - 1], *row[at + 1 :]])
    check_refused(policy, dataclasses.replace(dialogue, sample_logprobs=swapped), cfg, "dialogue", ("turn_boundary",))


def test_an_error_of_one_sign_at_every_token_is_refused_summed_over_the_row(trained_deep_folder):
    """Logprobs normalised over 2 % more mass than the sampler drew from (padding rows left in the softmax): every
    recorded logprob log(1.02) = 0.02 nats low. Per token that is half the noise's bound; summed over a row it adds
    up, where rounding noise grows only as the square root of the length."""
    cfg = TrainingConfig()
    policy = _policy(trained_deep_folder, 1.0)
    batch = sampled_batch(policy)
    check_margins(policy, batch, cfg, "trained_deep T=1.0")
    low = [[lp - math.log(1.02) for lp in row] for row in batch.sample_logprobs]
    measured = check_refused(policy, dataclasses.replace(batch, sample_logprobs=low), cfg, "2 % low", ("sequence",))
    assert measured["token"] < 1  # the per-token mean alone would have trained on it


def test_the_bound_is_the_samplers_a_trainer_side_temperature_does_not_raise_it(trained_deep_folder):
    """Self-inflation: a trainer that applies T = 0.7 to a batch drawn at T = 1 sharpens its own distribution; the
    bound is taken from the distribution the batch records, so it is the same as the correct run's."""
    cfg = TrainingConfig()
    policy = _policy(trained_deep_folder, 1.0)
    batch = sampled_batch(policy)
    before = {k: v.clone() for k, v in policy.adapter_state().items()}
    lifted = cfg.model_copy(update={"learning_rate": 0.0})
    correct = step(policy, make_optimizer(policy, lifted), batch, lifted)
    policy.distribution = SamplingDistribution(0.7, policy.distribution.suppressed_ids)
    with pytest.raises(RatioCheckError) as refused:
        step(policy, make_optimizer(policy, cfg), batch, cfg)
    assert f"bound {correct.sampler_kl_tolerance:.1e}" in str(refused.value)
    policy.load_adapter_state(before)
    # without the record, the trainer's own (sharper) distribution would set the bound: larger
    unrecorded = dataclasses.replace(batch, sampled_with=None)
    with pytest.raises(RatioCheckError) as inflated:
        step(policy, make_optimizer(policy, cfg), unrecorded, cfg)
    assert f"bound {correct.sampler_kl_tolerance:.1e}" not in str(inflated.value)


def test_the_default_bound_follows_the_dtype_and_noise_scale_and_a_set_one_wins():
    eps2 = 2.0**-14  # bfloat16
    assert first_update_tolerance(TrainingConfig(), torch.float32) == 1e-6
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16) == pytest.approx(eps2)  # the floor: one eps^2
    assert first_update_tolerance(TrainingConfig(), torch.float16) == 1e-6  # its eps^2, 2^-20, is below the floor
    # one eps^2 per unit of the noise scale
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, noise_scale=36.0) == 36 * eps2
    # a peaked distribution (noise scale near 0) falls to the floor, not to 0; the one-token gates' floor is higher
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, noise_scale=1e-6) == eps2
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, noise_scale=1e-6, floor_eps2=32.0) == 32 * eps2
    # another engine: 4x
    assert first_update_tolerance(TrainingConfig(), torch.bfloat16, noise_scale=36.0, other_engine=True) == 144 * eps2
    assert first_update_tolerance(TrainingConfig(), torch.float32, noise_scale=900.0) == 1e-6
    set_one = TrainingConfig(first_update_kl_tolerance=0.5)
    assert first_update_tolerance(set_one, torch.float32) == 0.5
    assert first_update_tolerance(set_one, torch.bfloat16, noise_scale=900.0, other_engine=True) == 0.5
    # a sequence of 100 tokens: the set bound per token times its tokens
    assert first_update_tolerance(set_one, torch.bfloat16, noise_scale=900.0, tokens=100) == 50.0


def test_on_a_cuda_gpu_the_in_process_samplers_bounds_are_another_engines():
    """On a GPU the cached decode and the packed forward run other kernels in every op: on an H200 (bfloat16, random
    Qwen3-4B, 64 rows of 256 tokens) a correct first update's sequence gate measured 1.02 of the CPU's bound."""
    from redteam_grpo.core.training.train import FIRST_UPDATE_GATES, FirstUpdateDiagnostics, GateSums

    sums = {g: GateSums(g, statistic=1e-3, noise_scale=72.0, tokens=2.0, items=2) for g in FIRST_UPDATE_GATES}
    diagnostics = FirstUpdateDiagnostics(gates=sums)
    cfg = TrainingConfig()
    cpu = diagnostics.bounds(cfg, torch.bfloat16, "hf", "cpu")
    for gate in FIRST_UPDATE_GATES:
        assert diagnostics.bounds(cfg, torch.bfloat16, "hf", "cuda")[gate] == pytest.approx(4 * cpu[gate])
        assert diagnostics.bounds(cfg, torch.bfloat16, "vllm", "cpu")[gate] == pytest.approx(4 * cpu[gate])
        assert diagnostics.bounds(cfg, torch.bfloat16, "vllm", "cuda")[gate] == pytest.approx(4 * cpu[gate])
    assert cpu["token"] == pytest.approx(36 * 2.0**-14)  # 72 eps^2 over 2 items


def test_the_noise_scale_is_the_depth_times_the_varentropy_plus_the_width_times_the_logits_magnitude_squared():
    varentropy_B_C = torch.tensor([[0.5, 0.0]])
    second_moment_B_C = torch.tensor([[100.0, 400.0]])
    scale = rounding_noise_scale(varentropy_B_C, second_moment_B_C, layers=36, hidden_size=2560)
    expected = 36 * varentropy_B_C + KL_BOUND_WIDTH_COEF * 2560**2 * second_moment_B_C
    assert torch.allclose(scale, expected)
    # the varentropy term grows with the depth; the logits are rounded once, at the head: not with the depth
    deeper = rounding_noise_scale(varentropy_B_C, second_moment_B_C, layers=72, hidden_size=2560)
    assert torch.allclose(deeper - scale, 36 * varentropy_B_C)
    # the same logits at twice the width: the logit term four times
    wider = rounding_noise_scale(varentropy_B_C, second_moment_B_C, layers=36, hidden_size=5120)
    assert torch.allclose(wider - 36 * varentropy_B_C, 4 * (scale - 36 * varentropy_B_C))
