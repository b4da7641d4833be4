"""One GRPO policy update on a sampled batch, and the diagnostics that show it is sound.

The forward runs on exactly the ids the sampler produced (prompt ids as fed to `generate`, completion ids as
drawn), through the same sampling distribution, so the first update's importance ratio pi_trainer /
pi_sampler is 1; it is checked every step and a step whose ratio is off is refused (the trainer would be
optimising a different distribution than the one sampled from).

Which rows take part: completions with at least one token; with dynamic sampling (DAPO, Yu et al. 2025) only
the groups with a non-zero advantage (`informative_rows`). DAPO then samples more prompts until the batch is
full again; here the batch only shrinks, and the number of groups left out is reported.

The first-update check: on the first update the trainer's logprobs are compared with the sampler's, and the step
is refused when KL(sampler || trainer) per token (k3 on the ratio, Schulman 2020) exceeds a tolerance. KL, not the
mean |ratio - 1|: the tokens were drawn from the sampler, so E[log p_sampler - log p_trainer] is the KL, which is
second order in rounding noise and first order in a real difference. Measured (KL per token): a correct float32 run
1e-12 or less; bfloat16 rounding, in-process or vLLM, 1.2e-5 on the embedded model and about 3e-4 for a Qwen3-4B
(cached decode against a full forward; mean |log-ratio| 0.02, max 0.08); misalignments on the embedded model in
bfloat16: the first prompt id dropped 3.1e-3, the temperature not replayed 3.2e-2, the mask one token late 4.9.
The rounding noise grows with the depth and with the square of the logits' scale: the same random Qwen3-4B with
logits spread 5x wider (squared scale 25) measured 3.7e-3 to 8.2e-3; a random 8-layer, 512-wide Qwen3 3e-6 to
3e-5 (squared scale 5). So the default tolerance (`first_update_tolerance`) is, in units of eps(dtype)^2, the number
of decoder layers times the logits' squared scale at the trained tokens (`logit_noise_scale`: their variance over
the vocabulary, reweighted to the LM-head rows the distribution draws), and at least 16 (9.8e-4 in bfloat16; in
float32 at least 1e-6): the noise measured 0.001 to 0.15 of that, the misalignments above it (on the 8-layer model
with squared scale 5: a first prompt id dropped 1.7e-2 against 2.7e-3; on the embedded model, 2 layers of squared
scale 16.5 at temperature 0.7, 3.1e-3 against 2.0e-3; on the random Qwen3-4B the smallest, an unreplayed
temperature, 0.11 against 5.4e-2). A misalignment cannot raise its own bound much: the scale is the trainer's
logits', which a lost id barely moves and a forgotten temperature below 1 lowers.

Engine-mismatch corrections, for a sampler that is another engine (`training.mismatch_correction`,
`core/training/loss.py: mismatch_weights`): the denominator of the ratio is the trainer's own logprobs at the sampling
weights, which are the first update's forward, detached, kept for the later updates of the batch (recomputing them
from the updated weights would make every ratio 1); each token's term is weighted by a factor of
p_trainer_old / p_sampler, truncated or masked. With the in-process sampler the factor is 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from redteam_grpo.core.config import TrainingConfig
from redteam_grpo.core.models.policy import Policy, span_logits
from redteam_grpo.core.rollouts.logprobs import entropy, logit_noise_scale, pad_ragged, token_logprobs
from redteam_grpo.core.training.batching import checkpointed_layers, micro_batches
from redteam_grpo.core.training.distributed import DataParallel
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
    """The first update's importance ratio is not 1: sampler and trainer disagree on the distribution."""


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

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
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
    sampler_kl: float  # KL(sampler || trainer) by k3 on the first update's ratio: 0 when they agree; the checked one
    sampler_kl_tolerance: float  # the largest sampler_kl the first update accepted (`first_update_tolerance`)
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


def make_optimizer(policy: Policy, cfg: TrainingConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        policy.trainable_parameters(),
        lr=cfg.learning_rate,
        betas=cfg.adam_betas,
        weight_decay=cfg.weight_decay,
    )


# The default first-update tolerance, in units of the compute dtype's machine epsilon squared: at least
# KL_TOLERANCE_EPS2, and KL_TOLERANCE_PER_LAYER_SCALE per decoder layer and unit of the logits' squared scale; never
# below the floor (see the module docstring for the measurements they sit between).
KL_TOLERANCE_EPS2 = 16.0
KL_TOLERANCE_PER_LAYER_SCALE = 1.0
KL_TOLERANCE_FLOOR = 1e-6


def first_update_tolerance(cfg: TrainingConfig, dtype: torch.dtype, layers: int = 1, logit_scale: float = 0.0) -> float:
    """The largest KL(sampler || trainer) per token the first update accepts: the configured one, else derived
    from the dtype the model computes in, its number of decoder layers and the squared scale of its logits (mean of
    `logit_noise_scale` over the trained tokens), the two that the rounding noise grows with.

    >>> first_update_tolerance(TrainingConfig(), torch.bfloat16)
    0.0009765625
    >>> first_update_tolerance(TrainingConfig(), torch.bfloat16, layers=36, logit_scale=25.0)  # 900 eps^2
    0.054931640625
    >>> first_update_tolerance(TrainingConfig(), torch.float32, layers=36, logit_scale=25.0)
    1e-06
    """
    if cfg.first_update_kl_tolerance is not None:
        return cfg.first_update_kl_tolerance
    eps2 = torch.finfo(dtype).eps ** 2
    units = max(KL_TOLERANCE_EPS2, KL_TOLERANCE_PER_LAYER_SCALE * layers * logit_scale)
    return max(units * eps2, KL_TOLERANCE_FLOOR)


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
    advantages)."""

    logprobs_B_C_V: torch.Tensor
    logprobs_B_C: torch.Tensor
    sample_B_C: torch.Tensor
    advantages_B: torch.Tensor  # [B]; per-turn advantages: [B, C]
    mask_B_C: torch.Tensor


def micro_batch_forward(policy: Policy, batch: TrainBatch, mb_rows: Sequence[int]) -> MicroBatchForward:
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
    return MicroBatchForward(logprobs_B_C_V, logprobs_B_C, sample_B_C, advantages_B, mask_B_C)


@dataclass
class FirstUpdateDiagnostics:
    """What the first update measures besides its loss, summed over its micro-batches: the trainer against the
    sampler (the first-update check's KL and ratio, the logprob mismatch), the entropy, and how many tokens and
    sequences the mismatch correction changed."""

    sampler: LossStats = field(default_factory=LossStats)
    entropy_sum: float = 0.0
    logit_scale_sum: float = 0.0  # of logit_noise_scale over the trained tokens
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
        head_row_norms_V: torch.Tensor | None = None,
    ) -> None:
        """One micro-batch. `loss_stats`: the loss's own statistics when its ratio is against the sampler (no
        correction); with a correction the loss's denominator is the trainer's, so the ratio is computed here.
        `head_row_norms_V`: the LM head's squared row norms (`Policy.head_row_norms`), for the logits' noise scale."""
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
        scale_B_C = logit_noise_scale(forward.logprobs_B_C_V.detach(), head_row_norms_V)
        self.logit_scale_sum += float(torch.where(mask_B_C, scale_B_C, torch.zeros_like(scale_B_C)).sum())
        if corrected_B_C is not None:
            self.corrected_tokens += int(corrected_B_C.sum())
            self.corrected_sequences += int(corrected_B_C.any(-1).sum())

    def all_reduced(self, dp: DataParallel) -> FirstUpdateDiagnostics:
        """Summed over the process group (the maximum of the largest mismatch)."""
        entropy_sum, scale_sum, mismatch_sum, mismatch_over, corrected_tokens, corrected_sequences = dp.sum(
            [
                self.entropy_sum,
                self.logit_scale_sum,
                self.mismatch_sum,
                self.mismatch_over,
                self.corrected_tokens,
                self.corrected_sequences,
            ]
        )
        (mismatch_max,) = dp.max([self.mismatch_max])
        return FirstUpdateDiagnostics(
            _all_reduced(self.sampler, dp),
            entropy_sum,
            scale_sum,
            mismatch_sum,
            mismatch_max,
            int(mismatch_over),
            int(corrected_tokens),
            int(corrected_sequences),
        )

    @property
    def logit_scale(self) -> float:
        """The mean of `logit_noise_scale` over the trained tokens."""
        return self.logit_scale_sum / max(self.sampler.n_tokens, 1)

    def tolerance(self, cfg: TrainingConfig, dtype: torch.dtype, layers: int) -> float:
        """`first_update_tolerance` for this batch."""
        return first_update_tolerance(cfg, dtype, layers, self.logit_scale)

    def check(self, tolerance: float, dtype: torch.dtype, layers: int) -> None:
        """Refuse the batch when the trainer does not see the distribution the tokens were sampled from."""
        if not self.sampler.kl <= tolerance:  # NaN too
            raise RatioCheckError(
                f"first update: the trainer's logprobs differ from the sampler's by KL {self.sampler.kl:.2e} "
                f"per token (tolerance {tolerance:.1e} for {str(dtype).removeprefix('torch.')}, {layers} layers, "
                f"logit scale² {self.logit_scale:.2g}; "
                f"mean |ratio - 1| {self.sampler.ratio_abs_dev:.2e}, largest |log-ratio| {self.mismatch_max:.2f}): "
                "the trainer does not see the distribution the tokens were sampled from (a misaligned mask, "
                "an unreplayed temperature or token suppression, other ids). The batch was not trained on. "
                "If the sampler computes in another dtype than model.dtype, or another engine's rounding is "
                "known to be larger, set training.first_update_kl_tolerance."
            )

    def row(
        self,
        loss: float,
        tolerance: float,
        clip_fraction: float,
        grad_norm: float,
        n_tokens: int,
        n_sequences: int,
        corrected: bool,
    ) -> dict[str, float]:
        """The first update's part of `UpdateStats`."""
        return {
            "loss": loss,
            "sampler_kl": self.sampler.kl,
            "sampler_kl_tolerance": tolerance,
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
        return UpdateStats(**unmeasured | measured | {"n_dropped_groups": float(n_dropped_groups)})

    compute_loss = loss_function(cfg)
    correction = cfg.correction(batch.sampler)
    low, high = cfg.mismatch_bounds
    layers = policy.decoder_layers
    head_row_norms_V = policy.head_row_norms()
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
                forward = micro_batch_forward(policy, batch, mb_rows)
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
                    diagnostics.add(forward, own_ratio, corrected_B_C, cfg.logprob_mismatch_threshold, head_row_norms_V)
            if data_parallel is not None:  # one step of the whole batch, in every process
                data_parallel.sum_gradients(params)
                (loss_total,) = data_parallel.sum([loss_total])
                stats = _all_reduced(stats, data_parallel)
                if diagnostics is not None:
                    diagnostics = diagnostics.all_reduced(data_parallel)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if diagnostics is not None:
                tolerance = diagnostics.tolerance(cfg, policy.compute_dtype, layers)
                diagnostics.check(tolerance, policy.compute_dtype, layers)
                first = diagnostics.row(
                    loss_total, tolerance, stats.clip_fraction, grad_norm, n_tokens, n_sequences, correction != "none"
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
    )
