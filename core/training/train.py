"""One GRPO policy update on a sampled batch, and the diagnostics that show it is sound.

The forward runs on exactly the ids the sampler produced (prompt ids as fed to `generate`, completion ids as
drawn), through the same sampling distribution, so the first update's importance ratio pi_trainer /
pi_sampler is 1; it is checked every step and a step whose ratio is off is refused (the trainer would be
optimising a different distribution than the one sampled from).

Which rows take part: completions with at least one token; with dynamic sampling (DAPO, Yu et al. 2025) only
the groups with a non-zero advantage (`informative_rows`). DAPO then samples more prompts until the batch is
full again; here the batch only shrinks, and the number of groups left out is reported.

The first-update check: on the first update the trainer's logprobs are compared with the sampler's, and the step is
refused when a gate's statistic exceeds its bound (`FIRST_UPDATE_GATES`). The statistic is KL(sampler || trainer), k3
on the ratio (Schulman 2020), not the mean |ratio - 1|: the tokens were drawn from the sampler, so
E[log p_sampler - log p_trainer] is the KL, second order in rounding noise and first order in a real difference. The
gates: k3 per token over every trained token; at each row's first trained token, at its last (the EOS) and at each
inner turn's first and last token, so an error at one token of a row is not divided by the row's length (an EOS
logprob recorded as 0 in a 256-token row is ~2e-3 per token); and half the square of each row's summed log-ratio, in
which a signed error adds up along the row while rounding noise grows only as its square root.

The bound follows the noise, from the distribution the tokens were drawn from (`TrainBatch.sampled_with`, the
sampler's recorded temperature: a trainer that applies another temperature cannot raise its own bound): per token,
eps(dtype)^2 x `rounding_noise_scale`, the decoder layers times the varentropy of that distribution (each layer
perturbs the hidden state, and a perturbation dz of the logits moves p by 1/2 Var_p(dz)) plus 6e-8 x (hidden size x
the logits' root-mean-square magnitude)^2 (the logits are rounded once, at the head, relative to their magnitude, and
two kernels round a wide model's apart more often); each
gate's bound is its items' mean, at least one eps^2 (32 for the gates of one token per row, whose mean of a few
heavy-tailed values fluctuates), times 4 for another engine (vLLM: other kernels in every op) and for the in-process
sampler on a CUDA GPU (the same there: `FirstUpdateDiagnostics.bounds`). Neither term alone
fits: per unit of layers x varentropy the noise measured 0.03 to 0.17 on a trained 8-layer, 128-wide model and 1.4 to
4.4 on a random 2-layer one of Qwen3-4B's width with spread logits (sd 5), which the logit term carries; on random
models with small logits the varentropy fits (0.07 to 0.3). The logit term does not grow with the depth: a random
Qwen3-4B at its 36 layers measured 5.8e-3 to 8.2e-3 per token (bench/README.md, section 8), about a third of the
2.4e-2 this law gives with the 2-layer model's distributions, where depth on that term would give 0.25.
Measured, bfloat16, statistic / bound at the default (tests/core/test_first_update_check.py and
tests/e2e/test_vllm_engine.py; correct run: largest over the gates, 256-token rows and dialogues included;
misalignment: largest over the gates made for it):

| model                             | T   | correct | shifted | other column | 1st ctx | temperature | EOS=0 | lost id |
|-----------------------------------|-----|---------|---------|--------------|---------|-------------|-------|---------|
| trained deep (8 layers, 128 wide) | 0.7 | 0.20    | 2.3e4   | 4.7e4        | 4.7e8   | 137         |       | (20x)   |
| trained deep                      | 1.0 | 0.13    | 1.4e4   | 3.8e4        | 4.6e6   | 98          | 184   | (20x)   |
| random, Qwen3-4B width, 2 layers  | 0.7 | 0.22    | 4.8e3   | 281          | 1.8e15  | 11          |       | 242     |
| random, Qwen3-4B width            | 1.0 | 0.25    | 3.3e4   | 4.3e3        | 1.2e11  | 141         | 85    | 320     |
| the CPU engine, embedded model    | 0.7 | 0.19    | 1.5e4   | 3.2e4        | 2.8e7   | 104         | 61    |         |
| the CPU engine, embedded model    | 1.0 | 0.11    | 1.3e4   | 2.6e4        | 4.4e5   | 111         | 89    |         |

(EOS=0 in 256-token rows: the last-token gate; the per-token mean of the same error on the wide model is 0.37 of its
bound, which is what the gate is for.) A first prompt id lost on the way is 17 to 36x its bound on the wide model and
4.2x on the trained deep model with a quarter of the vocabulary suppressed, but only 20x the noise on the trained deep
model without it, at both temperatures, where the noise per unit of the bound differs 6x: no bound from the
distribution holds both margins there. The ids are checked exactly instead (the sample stage stores the ids fed and
drawn, the trainer packs exactly those). A sampler one update behind moves the distribution by one learning-rate step,
which can be as small as the noise: the engine serves each version's adapter under a digest of its weights and a
response from another adapter is refused (tests/server/test_vllm_client.py: an adapter's name is a digest of its
weights; tests/e2e/test_vllm_engine.py: an adapter the engine does not hold is refused); the in-process sampler is the
trainer's own model, whose version `RunResources` tracks per role.

Engine-mismatch corrections, for a sampler that is another engine (`training.mismatch_correction`,
`core/training/loss.py: mismatch_weights`): the denominator of the ratio is the trainer's own logprobs at the sampling
weights, which are the first update's forward, detached, kept for the later updates of the batch (recomputing them
from the updated weights would make every ratio 1); each token's term is weighted by a factor of
p_trainer_old / p_sampler, truncated or masked. With the in-process sampler the factor is 1.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from redteam_grpo.core.config import TrainingConfig
from redteam_grpo.core.models.policy import Policy, span_logits
from redteam_grpo.core.tokens.logprobs import (
    SamplingDistribution,
    entropy,
    logit_second_moment,
    pad_ragged,
    token_logprobs,
    varentropy,
)
from redteam_grpo.core.training.batching import checkpointed_layers, micro_batches
from redteam_grpo.core.training.distributed import DataParallel
from redteam_grpo.core.training.kl import k3
from redteam_grpo.core.training.loss import (
    LossStats,
    gspo_loss,
    importance_sampling_loss,
    mismatch_weights,
    ppo_clip_loss,
    ratio_stats,
    token_weights,
)

LossFunction = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, LossStats]
]


class RatioCheckError(RuntimeError):
    """The first update's importance ratio is not 1: sampler and trainer disagree on the distribution. `gates`: each
    gate's (statistic, bound) as measured, the failed ones and the others (NaN where a gate had nothing to check)."""

    def __init__(self, message: str, gates: dict[str, tuple[float, float]] | None = None) -> None:
        super().__init__(message)
        self.gates = gates or {}


class NonFiniteUpdateError(RuntimeError):
    """An update's loss, gradient or new weights are not finite: the run stops before anything is checkpointed."""


_NON_FINITE_WAY_OUT = (
    "Nothing of this batch was checkpointed: lower training.learning_rate or set training.grad_clip, then resume "
    "the run (`redteam-grpo run --resume RUN_DIR`); it restarts from the last checkpoint."
)


def _require_finite_weights(params: Sequence[torch.Tensor], update: int) -> None:
    """Every trainable value finite after an optimizer step; else the step made the policy garbage."""
    bad = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
    if bad:
        total = sum(p.numel() for p in params)
        raise NonFiniteUpdateError(
            f"update {update} of the batch made {bad:,} of the adapter's {total:,} values NaN or infinite. "
            + _NON_FINITE_WAY_OUT
        )


@dataclass(frozen=True)
class TrainBatch:
    prompt_ids: Sequence[Sequence[int]]
    completion_ids: Sequence[Sequence[int]]
    sample_logprobs: Sequence[Sequence[float]]  # recorded by the sampler as each token was drawn
    advantages: Sequence[float]
    group_ids: Sequence[str]  # the prompt id of each row: rows with the same id form one GRPO group
    max_new_tokens: int | None = None  # the sampler's limit per turn; needed by the `constant` normalisation only
    # Dialogues (core/rollouts/dialogue.py speaker_row): row i's sequence is prompt_ids[i] + completion_ids[i] (its last
    # turn's prompt and the turn) and its trained tokens are those of spans[i], the speaker's own turns, with one
    # sampling logprob each. None: each row trains its completion (one span).
    spans: Sequence[Sequence[tuple[int, int]]] | None = None
    # dialogue.rewards=per_turn: row i's advantage per span (turn), given to that span's tokens; None: `advantages[i]`
    # for every trained token of row i
    turn_advantages: Sequence[Sequence[float]] | None = None
    sampler: str = "hf"  # the engine that drew the tokens and recorded sample_logprobs (sampling.backend)
    # The distribution the sampler drew from (its recorded temperature and suppressed ids): the first-update bound is
    # taken from it, so a trainer that applies another temperature cannot raise its own bound. None: the trainer's.
    sampled_with: SamplingDistribution | None = None
    # How many updates older than the trainer's weights at this step the weights that drew the batch are
    # (core/training/staleness.py). 0: the same weights, held to the first-update check. More: one step off-policy,
    # trained decoupled (the ratio against the trainer's own logprobs, each token weighted by the mismatch
    # correction's p_trainer / p_sampler), with no check: the sampler's weights are not the trainer's.
    staleness: int = 0

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if self.staleness < 0:
            raise ValueError(f"staleness {self.staleness}: a batch cannot be drawn by weights newer than the trainer's")
        lengths = (len(self.completion_ids), len(self.sample_logprobs), len(self.advantages), len(self.group_ids))
        if any(length != n for length in lengths) or (self.spans is not None and len(self.spans) != n):
            raise ValueError(
                f"prompt_ids, completion_ids, sample_logprobs, advantages, group_ids (and spans) differ in length: "
                f"{n}, " + ", ".join(map(str, lengths))
            )
        if self.turn_advantages is not None:
            if len(self.turn_advantages) != n:
                raise ValueError(f"{len(self.turn_advantages)} rows of turn advantages for {n} rows")
            for i, per_turn in enumerate(self.turn_advantages):
                if len(per_turn) != len(self.row_spans(i)):
                    raise ValueError(
                        f"row {i}: {len(per_turn)} turn advantages for {len(self.row_spans(i))} trained turns (spans)"
                    )
        for i, lps in enumerate(self.sample_logprobs):
            spans = self.row_spans(i)
            if sum(end - start for start, end in spans) != len(lps):
                raise ValueError(f"row {i}: {self.trained_tokens(i)} trained tokens but {len(lps)} sampling logprobs")
            longest = max((end - start for start, end in spans), default=0)
            if self.max_new_tokens is not None and longest > self.max_new_tokens:
                raise ValueError(f"row {i}: a turn of {longest} tokens, more than max_new_tokens={self.max_new_tokens}")

    def row_spans(self, i: int) -> list[tuple[int, int]]:
        """The [start, end) spans of row i's trained tokens in prompt_ids[i] + completion_ids[i]."""
        if self.spans is not None:
            return [tuple(span) for span in self.spans[i]]
        start = len(self.prompt_ids[i])
        return [(start, start + len(self.completion_ids[i]))]

    def trained_tokens(self, i: int) -> int:
        return sum(end - start for start, end in self.row_spans(i))

    def token_advantages(self, i: int) -> list[float]:
        """Row i's advantage of each trained token, in the order of its spans (that of its sampling logprobs)."""
        spans = self.row_spans(i)
        if self.turn_advantages is None:
            return [float(self.advantages[i])] * sum(end - start for start, end in spans)
        return [
            float(a) for (start, end), a in zip(spans, self.turn_advantages[i], strict=True) for _ in range(end - start)
        ]

    def informative(self, i: int) -> bool:
        """Row i carries a gradient: a non-zero advantage on some turn."""
        if self.turn_advantages is None:
            return self.advantages[i] != 0.0
        return any(a != 0.0 for a in self.turn_advantages[i])

    @property
    def max_trained_tokens(self) -> int | None:
        """The most tokens a row may train: max_new_tokens per turn, times the turns of the longest row."""
        if self.max_new_tokens is None:
            return None
        return self.max_new_tokens * max((len(self.row_spans(i)) for i in range(len(self.prompt_ids))), default=1)


@dataclass(frozen=True)
class UpdateStats:
    """Diagnostics of `policy_gradient_step`. Ratio, clip, loss, gradient-norm and entropy values are those of
    the first update (where the ratio compares trainer and sampler); `last_ratio_std` is of the last update."""

    loss: float  # the first update's loss
    sampler_kl: float  # KL(sampler || trainer) per token by k3 on the first update's ratio: 0 when they agree
    sampler_kl_tolerance: float  # the largest sampler_kl the first update accepts (`first_update_tolerance`)
    # The first-update check's other gates (`FIRST_UPDATE_GATES`), each with its own bound; NaN where a gate has nothing
    # to check (turn boundaries of single-turn rows): k3 at each row's first trained token, at its last (the EOS), at
    # the first and last token of each inner turn of a dialogue, and half the squared log-ratio summed over a sequence
    sampler_kl_first_token: float
    sampler_kl_first_token_bound: float
    sampler_kl_last_token: float
    sampler_kl_last_token_bound: float
    sampler_kl_turn_boundary: float
    sampler_kl_turn_boundary_bound: float
    sampler_kl_sequence: float
    sampler_kl_sequence_bound: float
    varentropy: float  # mean per-token varentropy of the distribution the tokens were drawn from, first update
    ratio_mean: float
    ratio_std: float  # sample std (n - 1)
    ratio_max: float
    first_ratio_abs_dev: float  # mean |ratio - 1| on the first update
    clip_fraction: float  # share of tokens whose term was clipped on the first update
    grad_norm: float  # before clipping, first update
    entropy: float  # mean per-token entropy of the sampling distribution, first update
    n_tokens: float  # completion tokens trained on
    n_sequences: float  # sequences trained on (non-empty, and in an informative group with dynamic sampling)
    n_dropped_groups: float  # groups left out by dynamic sampling (all advantages 0)
    last_ratio_std: float  # ratio std on the last update: must move from 0; NaN with one update per batch
    logprob_mismatch_mean: float  # mean |trainer - sampler| logprob per token, first update (another engine's kernels)
    logprob_mismatch_max: float
    logprob_mismatch_share: float  # share of tokens whose |trainer - sampler| > training.logprob_mismatch_threshold
    correction_token_share: float  # share of tokens the mismatch correction truncated or masked; NaN when off
    correction_sequence_share: float  # share of sequences with such a token (sequence_mask: masked); NaN when off
    staleness: float  # updates between the weights that drew the batch and the trainer's (TrainBatch.staleness)


def make_optimizer(policy: Policy, cfg: TrainingConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        policy.trainable_parameters(),
        lr=cfg.learning_rate,
        betas=cfg.adam_betas,
        weight_decay=cfg.weight_decay,
    )


# The default first-update bound per token, in units of the compute dtype's machine epsilon squared: the token's
# rounding-noise scale (`rounding_noise_scale`), whose logit term has the coefficient KL_BOUND_WIDTH_COEF; a gate's
# bound is at least KL_BOUND_FLOOR_EPS2 eps^2 and KL_BOUND_FLOOR (the module docstring gives the measurements they are
# fitted to).
KL_BOUND_WIDTH_COEF = 6e-8
KL_BOUND_FLOOR_EPS2 = 1.0
KL_BOUND_FLOOR = 1e-6
# The gates of one token per row (first_token, last_token, turn_boundary) average few values of a heavy-tailed noise
# (one kernel's rounding flip at one row's token dominates their mean), so their floor is higher: the CPU engine's
# first tokens measured 2.2 to 8.5 eps^2 on the embedded model, whose peaked first tokens have a noise scale near 0.
KL_BOUND_FEW_ITEMS_FLOOR_EPS2 = 32.0
# Another engine (vLLM) computes every op with other kernels than the trainer's, not only the ops whose shapes differ
# between a cached decode and a full forward: its bounds are this many times the in-process sampler's (the CPU engine
# measured 0.35 to 0.75 of the in-process bound on the embedded model).
KL_BOUND_OTHER_ENGINE_FACTOR = 4.0


def rounding_noise_scale(
    varentropy_B_C: torch.Tensor, second_moment_B_C: torch.Tensor, layers: int, hidden_size: int
) -> torch.Tensor:
    """The scale of the KL that rounding adds at each token, in eps^2, from the distribution the token was drawn from:
    the decoder layers times its varentropy (each layer perturbs the hidden state, and the varentropy is how much a
    perturbation moves the distribution) plus KL_BOUND_WIDTH_COEF x (hidden size x its logits' root-mean-square
    magnitude)^2 (the logits are rounded once, at the head, relative to their magnitude, and two kernels round a wide
    model's apart more often). Measured fit: the module docstring.

    >>> rounding_noise_scale(torch.tensor([0.5]), torch.tensor([100.0]), layers=8, hidden_size=100)
    tensor([4.0600])
    """
    return layers * varentropy_B_C + KL_BOUND_WIDTH_COEF * hidden_size**2 * second_moment_B_C


def first_update_tolerance(
    cfg: TrainingConfig,
    dtype: torch.dtype,
    noise_scale: float = 0.0,
    tokens: float = 1.0,
    floor_eps2: float = KL_BOUND_FLOOR_EPS2,
    other_engine: bool = False,
) -> float:
    """The largest KL(sampler || trainer) the first update accepts on one item of a gate (a token; a sequence) of
    `tokens` trained tokens whose `rounding_noise_scale` sums to `noise_scale`: the configured bound per token times
    the tokens, else eps^2 of the dtype the model computes in x the noise scale, at least
    `floor_eps2` eps^2 and KL_BOUND_FLOOR; KL_BOUND_OTHER_ENGINE_FACTOR times that for `other_engine` (a sampler
    that is not the trainer's own model, as vLLM).

    >>> first_update_tolerance(TrainingConfig(), torch.bfloat16)  # the floor: one eps^2
    6.103515625e-05
    >>> first_update_tolerance(TrainingConfig(), torch.bfloat16, noise_scale=72.0)  # 72 eps^2
    0.00439453125
    >>> first_update_tolerance(TrainingConfig(), torch.float32, noise_scale=72.0)
    1e-06
    """
    if cfg.first_update_kl_tolerance is not None:
        return cfg.first_update_kl_tolerance * tokens
    eps2 = torch.finfo(dtype).eps ** 2
    factor = KL_BOUND_OTHER_ENGINE_FACTOR if other_engine else 1.0
    return max(factor * max(floor_eps2, noise_scale) * eps2, KL_BOUND_FLOOR)


def informative_rows(group_ids: Sequence[str], advantages: Sequence[float]) -> tuple[list[int], int]:
    """DAPO's dynamic-sampling filter (Yu et al. 2025): the rows of the groups that have a non-zero advantage,
    and the number of groups left out. A group whose advantages are all 0 adds nothing to the gradient but
    its tokens to the normaliser, which would shrink every other group's step.

    >>> informative_rows(["a", "a", "b", "b"], [0.5, -0.5, 0.0, 0.0])
    ([0, 1], 1)
    """
    informative: dict[str, bool] = {}
    for group, advantage in zip(group_ids, advantages, strict=True):
        informative[group] = informative.get(group, False) or advantage != 0.0
    rows = [i for i, group in enumerate(group_ids) if informative[group]]
    return rows, sum(not keep for keep in informative.values())


def loss_function(cfg: TrainingConfig) -> LossFunction:
    """The configured loss with its clip ranges bound."""
    losses: dict[str, LossFunction] = {
        "importance_sampling": importance_sampling_loss,
        "ppo_clip": functools.partial(
            ppo_clip_loss, epsilon_low=cfg.ppo_clip_epsilon_low, epsilon_high=cfg.ppo_clip_epsilon_high
        ),
        "gspo": functools.partial(gspo_loss, epsilon_low=cfg.gspo_epsilon_low, epsilon_high=cfg.gspo_epsilon_high),
    }
    return losses[cfg.loss]


def _all_reduced(stats: LossStats, dp: DataParallel) -> LossStats:
    n_tokens, dev, dev_sq, abs_dev, k3, n_clipped = dp.sum(
        [
            stats.n_tokens,
            stats.ratio_dev_sum,
            stats.ratio_dev_sq_sum,
            stats.ratio_abs_dev_sum,
            stats.k3_sum,
            stats.n_clipped,
        ]
    )
    (ratio_max,) = dp.max([stats.ratio_max])
    return LossStats(int(n_tokens), dev, dev_sq, abs_dev, ratio_max, k3, int(n_clipped))


@dataclass(frozen=True)
class MicroBatchForward:
    """One micro-batch through the trainer: per trained token, the trainer's logprob (with the whole vocabulary's,
    for the entropy) and the sampler's recorded one, and the advantage (per row, or per token with per-turn
    advantages). On the first update, of the distribution the sampler drew from (`TrainBatch.sampled_with`), from the
    trainer's raw logits: its varentropy and its `rounding_noise_scale`, for the first-update bounds."""

    logprobs_B_C_V: torch.Tensor
    logprobs_B_C: torch.Tensor
    sample_B_C: torch.Tensor
    advantages_B: torch.Tensor  # [B]; per-turn advantages: [B, C]
    mask_B_C: torch.Tensor
    varentropy_B_C: torch.Tensor | None = None
    noise_scale_B_C: torch.Tensor | None = None


def micro_batch_forward(
    policy: Policy, batch: TrainBatch, mb_rows: Sequence[int], first_update: bool = False
) -> MicroBatchForward:
    """The trainer's forward on the rows `mb_rows`: the ids as sampled, the sampling distribution replayed."""
    logits_B_C_V, ids_B_C, mask_B_C = span_logits(
        policy,
        [[*batch.prompt_ids[i], *batch.completion_ids[i]] for i in mb_rows],
        [batch.row_spans(i) for i in mb_rows],
    )
    logprobs_B_C_V = policy.distribution.logprobs(logits_B_C_V)
    logprobs_B_C = token_logprobs(logprobs_B_C_V, ids_B_C)
    sample_B_C = pad_ragged([batch.sample_logprobs[i] for i in mb_rows], ids_B_C.shape[1]).to(policy.device)
    if batch.turn_advantages is None:
        advantages_B = torch.tensor([batch.advantages[i] for i in mb_rows], dtype=torch.float32, device=policy.device)
    else:  # per-turn: [B, C], each trained token its turn's advantage (padding: 0, masked anyway)
        advantages_B = pad_ragged([batch.token_advantages(i) for i in mb_rows], ids_B_C.shape[1], 0.0).to(policy.device)
    varentropy_B_C = noise_scale_B_C = None
    if first_update:  # the sampler's distribution, whatever the trainer replays: a trainer-side error cannot raise it
        with torch.no_grad():
            sampled_with = batch.sampled_with or policy.distribution
            processed_B_C_V = sampled_with.process(logits_B_C_V.detach())
            # the trainer's own logprobs when it replays that distribution (one pass over the vocabulary less)
            sampled_B_C_V = (
                logprobs_B_C_V.detach()
                if sampled_with == policy.distribution
                else torch.log_softmax(processed_B_C_V, dim=-1)
            )
            varentropy_B_C = varentropy(sampled_B_C_V)
            second_moment_B_C = logit_second_moment(processed_B_C_V, sampled_B_C_V)
            noise_scale_B_C = rounding_noise_scale(
                varentropy_B_C, second_moment_B_C, policy.decoder_layers, policy.hidden_size
            )
            del processed_B_C_V, sampled_B_C_V
    return MicroBatchForward(
        logprobs_B_C_V, logprobs_B_C, sample_B_C, advantages_B, mask_B_C, varentropy_B_C, noise_scale_B_C
    )


# The first-update check's gates: each a statistic over its items and a bound, so that an error at one token of each
# sequence is held against the noise of those tokens, not divided by the sequence's length. token: k3 at every trained
# token; first_token / last_token: at each row's first / last trained token (the first completion token, the EOS);
# turn_boundary: at the first and last token of every other turn of a dialogue row; sequence: half the square of the
# row's summed log-ratio (a signed error adds up along the row, rounding noise only as its square root).
FIRST_UPDATE_GATES = ("token", "first_token", "last_token", "turn_boundary", "sequence")
_GATE_NAMES = {
    "token": "per token",
    "first_token": "at each row's first trained token",
    "last_token": "at each row's last trained token",
    "turn_boundary": "at the turn boundaries",
    "sequence": "summed over each sequence",
}


@dataclass
class GateSums:
    """One gate's statistic, its items' rounding-noise scale and trained tokens, summed over its items."""

    gate: str
    statistic: float = 0.0
    noise_scale: float = 0.0
    tokens: float = 0.0
    items: int = 0

    def add(self, statistic: torch.Tensor, noise_scale: torch.Tensor, tokens: torch.Tensor) -> None:
        self.statistic += float(statistic.double().sum())
        self.noise_scale += float(noise_scale.double().sum())
        self.tokens += float(tokens.double().sum())
        self.items += int(statistic.numel())

    @property
    def value(self) -> float:
        return self.statistic / self.items if self.items else math.nan

    def bound(self, cfg: TrainingConfig, dtype: torch.dtype, other_engine: bool) -> float:
        if not self.items:
            return math.nan
        floor = KL_BOUND_FLOOR_EPS2 if self.gate in ("token", "sequence") else KL_BOUND_FEW_ITEMS_FLOOR_EPS2
        scale, tokens = self.noise_scale / self.items, self.tokens / self.items
        return first_update_tolerance(cfg, dtype, scale, tokens, floor, other_engine)


def _gate_positions(span_lengths: Sequence[Sequence[int]], width: int) -> dict[str, torch.Tensor]:
    """Bool [B, C] masks of the first_token, last_token and turn_boundary gates' tokens: a row's trained tokens fill
    its columns 0..n-1, span after span."""
    first = torch.zeros(len(span_lengths), width, dtype=torch.bool)
    last, boundary = first.clone(), first.clone()
    for b, lengths in enumerate(span_lengths):
        ends = list(itertools.accumulate(lengths))
        starts = [e - n for e, n in zip(ends, lengths, strict=True)]
        kept = [(s, e) for s, e in zip(starts, ends, strict=True) if e > s]
        if not kept:
            continue
        first[b, kept[0][0]] = True
        last[b, kept[-1][1] - 1] = True
        for s, e in kept:
            boundary[b, s] = boundary[b, e - 1] = True
        boundary[b, kept[0][0]] = boundary[b, kept[-1][1] - 1] = False
    return {"first_token": first, "last_token": last, "turn_boundary": boundary}


@dataclass
class FirstUpdateDiagnostics:
    """What the first update measures besides its loss, summed over its micro-batches: the trainer against the
    sampler (the first-update check's gates, the ratio, the logprob mismatch), the entropy, and how many tokens and
    sequences the mismatch correction changed."""

    sampler: LossStats = field(default_factory=LossStats)
    gates: dict[str, GateSums] = field(default_factory=lambda: {g: GateSums(g) for g in FIRST_UPDATE_GATES})
    entropy_sum: float = 0.0
    varentropy_sum: float = 0.0
    mismatch_sum: float = 0.0
    mismatch_max: float = 0.0
    mismatch_over: int = 0
    corrected_tokens: int = 0
    corrected_sequences: int = 0

    def add(
        self,
        forward: MicroBatchForward,
        loss_stats: LossStats | None,
        corrected_B_C: torch.Tensor | None,
        mismatch_threshold: float,
        span_lengths: Sequence[Sequence[int]],
    ) -> None:
        """One micro-batch. `loss_stats`: the loss's own statistics when its ratio is against the sampler (no
        correction); with a correction the loss's denominator is the trainer's, so the ratio is computed here.
        `span_lengths`: the trained tokens of each row's turns, in order (one turn outside dialogues)."""
        mask_B_C = forward.mask_B_C
        logprobs_B_C = forward.logprobs_B_C.detach()
        self.sampler = self.sampler + (
            loss_stats if loss_stats is not None else ratio_stats(forward.logprobs_B_C, forward.sample_B_C, mask_B_C)
        )
        mismatch_B_C = torch.where(mask_B_C, (logprobs_B_C - forward.sample_B_C).abs(), 0.0)
        self.mismatch_sum += float(mismatch_B_C.sum())
        self.mismatch_max = max(self.mismatch_max, float(mismatch_B_C.max()))
        self.mismatch_over += int((mismatch_B_C > mismatch_threshold).sum())
        entropy_B_C = entropy(forward.logprobs_B_C_V.detach())
        self.entropy_sum += float(torch.where(mask_B_C, entropy_B_C, torch.zeros_like(entropy_B_C)).sum())
        if corrected_B_C is not None:
            self.corrected_tokens += int(corrected_B_C.sum())
            self.corrected_sequences += int(corrected_B_C.any(-1).sum())
        # the gates, in float64: a k3 of rounding noise is ~1e-9 per token
        log_ratio_B_C = torch.where(mask_B_C, logprobs_B_C.double() - forward.sample_B_C.double(), 0.0)
        k3_B_C = k3(log_ratio_B_C)
        assert forward.noise_scale_B_C is not None and forward.varentropy_B_C is not None, "a first update's forward"
        self.varentropy_sum += float(torch.where(mask_B_C, forward.varentropy_B_C, 0.0).sum())
        scale_B_C = torch.where(mask_B_C, forward.noise_scale_B_C.double(), 0.0)
        self.gates["token"].add(k3_B_C[mask_B_C], scale_B_C[mask_B_C], torch.ones(int(mask_B_C.sum())))
        for gate, where_B_C in _gate_positions(span_lengths, mask_B_C.shape[1]).items():
            where_B_C = where_B_C.to(mask_B_C.device) & mask_B_C
            self.gates[gate].add(k3_B_C[where_B_C], scale_B_C[where_B_C], torch.ones(int(where_B_C.sum())))
        rows_B = mask_B_C.any(-1)
        self.gates["sequence"].add(
            (0.5 * log_ratio_B_C.sum(-1).square())[rows_B], scale_B_C.sum(-1)[rows_B], mask_B_C.sum(-1)[rows_B]
        )

    def all_reduced(self, dp: DataParallel) -> FirstUpdateDiagnostics:
        """Summed over the process group (the maximum of the largest mismatch)."""
        gate_values = [v for g in FIRST_UPDATE_GATES for v in dataclasses.astuple(self.gates[g])[1:]]
        summed = dp.sum(
            [
                self.entropy_sum,
                self.varentropy_sum,
                self.mismatch_sum,
                self.mismatch_over,
                self.corrected_tokens,
                self.corrected_sequences,
                *gate_values,
            ]
        )
        entropy_sum, varentropy_sum, mismatch_sum, mismatch_over, corrected_tokens, corrected_sequences = summed[:6]
        fields_per_gate = len(dataclasses.fields(GateSums)) - 1
        gates = {
            g: GateSums(g, *summed[6 + k * fields_per_gate : 6 + (k + 1) * fields_per_gate])
            for k, g in enumerate(FIRST_UPDATE_GATES)
        }
        for gate in gates.values():
            gate.items = int(gate.items)
        (mismatch_max,) = dp.max([self.mismatch_max])
        return FirstUpdateDiagnostics(
            _all_reduced(self.sampler, dp),
            gates,
            entropy_sum,
            varentropy_sum,
            mismatch_sum,
            mismatch_max,
            int(mismatch_over),
            int(corrected_tokens),
            int(corrected_sequences),
        )

    def bounds(self, cfg: TrainingConfig, dtype: torch.dtype, sampler: str, device_type: str) -> dict[str, float]:
        """Each gate's bound for this batch (NaN where the gate has no item); `sampler`: the engine that drew it;
        `device_type`: where the trainer computes. On a CUDA GPU the in-process sampler's cached decode and the
        trainer's packed forward run other kernels in every op (cuBLAS chooses a GEMM by its shape, attention its
        backend by mask and length), as another engine does: its bound is another engine's (measured on an H200,
        bfloat16, a random Qwen3-4B, 64 rows of 256 tokens: the sequence gate at 1.02 of the CPU's bound)."""
        other_kernels = sampler != "hf" or device_type == "cuda"
        return {g: self.gates[g].bound(cfg, dtype, other_kernels) for g in FIRST_UPDATE_GATES}

    def check(self, bounds: dict[str, float], dtype: torch.dtype, layers: int) -> None:
        """Refuse the batch when the trainer does not see the distribution the tokens were sampled from: a gate's
        statistic above its bound (NaN too)."""
        failed = [g for g in FIRST_UPDATE_GATES if self.gates[g].items and not self.gates[g].value <= bounds[g]]
        if not failed:
            return
        tokens = self.gates["token"]
        where = "; ".join(f"KL {self.gates[g].value:.2e} {_GATE_NAMES[g]} (bound {bounds[g]:.1e})" for g in failed)
        raise RatioCheckError(
            f"first update: the trainer's logprobs differ from the sampler's: {where} "
            f"({str(dtype).removeprefix('torch.')}, {layers} layers, rounding-noise scale "
            f"{tokens.noise_scale / max(tokens.items, 1):.2g} per token; "
            f"mean |ratio - 1| {self.sampler.ratio_abs_dev:.2e}, largest |log-ratio| {self.mismatch_max:.2f}): "
            "the trainer does not see the distribution the tokens were sampled from (a misaligned mask, "
            "an unreplayed temperature or token suppression, other ids, a logprob recorded for another token). "
            "The batch was not trained on. If the sampler computes in another dtype than model.dtype, or another "
            "engine's rounding is known to be larger, set training.first_update_kl_tolerance (per token).",
            {g: (self.gates[g].value, bounds[g]) for g in FIRST_UPDATE_GATES},
        )

    def row(
        self,
        loss: float,
        bounds: dict[str, float],
        clip_fraction: float,
        grad_norm: float,
        n_tokens: int,
        n_sequences: int,
        corrected: bool,
    ) -> dict[str, float]:
        """The first update's part of `UpdateStats`."""
        gate_columns = {}
        for gate in FIRST_UPDATE_GATES[1:]:
            gate_columns[f"sampler_kl_{gate}"] = self.gates[gate].value
            gate_columns[f"sampler_kl_{gate}_bound"] = bounds[gate]
        return {
            "loss": loss,
            "sampler_kl": self.gates["token"].value,  # what the check held against sampler_kl_tolerance
            "sampler_kl_tolerance": bounds["token"],
            **gate_columns,
            "varentropy": self.varentropy_sum / n_tokens,
            "ratio_mean": self.sampler.ratio_mean,
            "ratio_std": self.sampler.ratio_std,
            "ratio_max": self.sampler.ratio_max,
            "first_ratio_abs_dev": self.sampler.ratio_abs_dev,
            "clip_fraction": clip_fraction,
            "grad_norm": grad_norm,
            "entropy": self.entropy_sum / n_tokens,
            "logprob_mismatch_mean": self.mismatch_sum / n_tokens,
            "logprob_mismatch_max": self.mismatch_max,
            "logprob_mismatch_share": self.mismatch_over / n_tokens,
            "correction_token_share": self.corrected_tokens / n_tokens if corrected else math.nan,
            "correction_sequence_share": self.corrected_sequences / n_sequences if corrected else math.nan,
        }


def policy_gradient_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    cfg: TrainingConfig,
    data_parallel: DataParallel | None = None,
) -> UpdateStats:
    """`cfg.updates_per_batch` optimizer steps on the batch; returns the diagnostics of the first and last.
    `data_parallel`: this process computes its share of the micro-batches and the gradients and statistics are
    summed over the process group before each step (`core/training/distributed.py`); every process returns the same."""
    if cfg.loss_normalization == "constant" and batch.max_new_tokens is None:
        raise ValueError(
            "training.loss_normalization=constant divides by sequences x max_new_tokens: build the TrainBatch "
            "with max_new_tokens (sampling.max_new_tokens)"
        )
    rows = [i for i in range(len(batch.completion_ids)) if batch.trained_tokens(i) > 0]
    n_dropped_groups = 0
    if cfg.dynamic_sampling:
        kept, n_dropped_groups = informative_rows(
            [batch.group_ids[i] for i in rows], [float(batch.informative(i)) for i in rows]
        )
        rows = [rows[k] for k in kept]
    n_tokens = sum(batch.trained_tokens(i) for i in rows)
    n_sequences = len(rows)
    if not rows:  # nothing to learn from: no step (Adam's state and step count are left alone)
        unmeasured = dict.fromkeys((f.name for f in dataclasses.fields(UpdateStats)), math.nan)
        measured = {"loss": 0.0, "grad_norm": 0.0, "n_tokens": 0.0, "n_sequences": 0.0}
        measured["staleness"] = float(batch.staleness)
        return UpdateStats(**unmeasured | measured | {"n_dropped_groups": float(n_dropped_groups)})

    compute_loss = loss_function(cfg)
    correction = cfg.correction(batch.sampler)
    if batch.staleness and correction == "none":
        raise ValueError(
            f"a batch drawn by weights {batch.staleness} update(s) older than the trainer's needs a mismatch "
            "correction: its ratio is taken against the trainer's own logprobs and each token weighted by p_trainer / "
            "p_sampler (set training.mismatch_correction, e.g. token_truncate)"
        )
    low, high = cfg.mismatch_bounds
    layers = policy.decoder_layers
    lengths = [len(batch.prompt_ids[i]) + len(batch.completion_ids[i]) for i in range(len(batch.completion_ids))]
    batches = micro_batches(rows, lengths, cfg.micro_batch_size, cfg.micro_batch_tokens)
    if data_parallel is not None:
        batches = data_parallel.share(batches)
    trainer_old: list[torch.Tensor] = []  # a correction's pi_old: the first update's logprobs, one per micro-batch
    params = policy.trainable_parameters()
    max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
    first: dict[str, float] = {}
    with checkpointed_layers(policy.model, cfg.gradient_checkpointing):
        for update in range(cfg.updates_per_batch):
            optimizer.zero_grad(set_to_none=True)
            loss_total, stats = 0.0, LossStats()
            diagnostics = FirstUpdateDiagnostics() if update == 0 else None
            for k, mb_rows in enumerate(batches):
                forward = micro_batch_forward(policy, batch, mb_rows, first_update=diagnostics is not None)
                weights_B_C = token_weights(
                    forward.mask_B_C, cfg.loss_normalization, n_tokens, n_sequences, batch.max_trained_tokens
                ).to(policy.device)
                corrected_B_C = None
                if correction == "none":
                    old_B_C = forward.sample_B_C
                else:
                    if update == 0:
                        trainer_old.append(forward.logprobs_B_C.detach())
                    old_B_C = trainer_old[k]
                    factors_B_C, corrected_B_C = mismatch_weights(
                        old_B_C, forward.sample_B_C, forward.mask_B_C, correction, low, high
                    )
                    weights_B_C = weights_B_C * factors_B_C
                loss, mb_stats = compute_loss(
                    forward.logprobs_B_C, old_B_C, forward.advantages_B, weights_B_C, forward.mask_B_C
                )
                loss.backward()
                loss_total += float(loss.detach())
                stats = stats + mb_stats
                if diagnostics is not None:
                    own_ratio = mb_stats if correction == "none" else None  # the loss's ratio is the sampler's
                    spans = [[end - start for start, end in batch.row_spans(i)] for i in mb_rows]
                    diagnostics.add(forward, own_ratio, corrected_B_C, cfg.logprob_mismatch_threshold, spans)
            if data_parallel is not None:  # one step of the whole batch, in every process
                data_parallel.sum_gradients(params)
                (loss_total,) = data_parallel.sum([loss_total])
                stats = _all_reduced(stats, data_parallel)
                if diagnostics is not None:
                    diagnostics = diagnostics.all_reduced(data_parallel)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if diagnostics is not None:
                bounds = diagnostics.bounds(cfg, policy.compute_dtype, batch.sampler, policy.device.type)
                if batch.staleness == 0:  # a stale batch's sampler_kl is KL(behaviour || current), reported alone
                    diagnostics.check(bounds, policy.compute_dtype, layers)
                first = diagnostics.row(
                    loss_total, bounds, stats.clip_fraction, grad_norm, n_tokens, n_sequences, correction != "none"
                )
            if not (math.isfinite(grad_norm) and math.isfinite(loss_total)):
                raise NonFiniteUpdateError(
                    f"update {update} of the batch has a non-finite loss ({loss_total}) or gradient norm "
                    f"({grad_norm}); the step was not taken. " + _NON_FINITE_WAY_OUT
                )
            optimizer.step()
            _require_finite_weights(params, update)
    if data_parallel is not None:
        data_parallel.check_same_weights(params)
    return UpdateStats(
        **first,
        n_tokens=float(n_tokens),
        n_sequences=float(n_sequences),
        n_dropped_groups=float(n_dropped_groups),
        last_ratio_std=stats.ratio_std if cfg.updates_per_batch > 1 else math.nan,
        staleness=float(batch.staleness),
    )
