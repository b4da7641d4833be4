"""The per-iteration metrics: one registry that names, describes and formats every metric once.

Each metric is computed once, in `core`, by the stage that owns its inputs, and returned as a typed record:
`RolloutStats` (sample: `core/rollouts/diagnostics.py`), `ScoreStats` (score: `core/training/rewards.py`),
`AdvantageStats` (advantage: `core/training/advantages.py`), `UpdateStats` (train step: `core/training/train.py`). The
train step merges them into the iteration's metrics row (`iteration_metrics`), whose columns are exactly `METRICS`
below; every view — the flow's log line, the CLI's iteration table, `inspect`'s summary, the report's plots, the Prefect
artifact — reads this registry, so a metric is named and shown the same way everywhere.

Conventions: a standard deviation is the sample std (n − 1, Bessel's correction) everywhere; a metric that does
not apply to a run (novelty when its weight is 0) is NaN in the file and left out of every display.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

# Where a metric is shown. The Prefect artifact and `inspect --sql` always show every metric.
LOG = "log"  # the one line logged per iteration
TABLE = "table"  # the iteration table the CLI prints at the end of a run
SUMMARY = "summary"  # `redteam-grpo inspect RUN`
REPORT = "report"  # a plot in `redteam-grpo report`
CHECK = "check"  # `redteam-grpo inspect RUN`'s first-update check table: each gate's statistic beside its bound


@dataclass(frozen=True)
class Metric:
    name: str  # column of the metrics file and key of every record
    description: str
    header: str  # short label for tables and the log line
    fmt: str = "{:.3f}"
    views: frozenset[str] = frozenset()

    def format(self, value: float) -> str:
        """The value as shown; empty for NaN (a term switched off)."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        if self.fmt == "{:d}":
            return str(int(value))
        return self.fmt.format(value)


def _m(name: str, header: str, description: str, fmt: str = "{:.3f}", *views: str) -> Metric:
    return Metric(name, description, header, fmt, frozenset(views))


_ALL = (LOG, TABLE, SUMMARY, REPORT)

METRICS: tuple[Metric, ...] = (
    # -- reward (AdvantageStats: the batch statistics the advantages were computed from) ----------------------
    _m("reward_mean", "reward", "Mean reward over the completions with a valid reward.", "{:.3f}", *_ALL),
    _m("reward_std", "reward σ", "Sample std (n − 1) of the valid rewards; the batch z-score divides by it."),
    _m("n_invalid_rewards", "invalid", "Completions without a valid reward (advantage 0).", "{:.0f}"),
    _m("n_degenerate_groups", "flat groups", "Groups whose rewards do not differ (advantage 0).", "{:.0f}"),
    # -- scores (ScoreStats) ------------------------------------------------------------------------------------
    _m("harm_mean", "harm", "Mean harm score of the scored completions.", "{:.3f}", *_ALL),
    _m("repetition_mean", "rep", "Mean repeated n-gram ratio of the completions.", "{:.3f}", *_ALL),
    _m("novelty_mean", "nov", "Mean novelty; NaN when reward.novelty_weight is 0.", "{:.3f}", LOG, SUMMARY, REPORT),
    _m("refusal_rate", "refus", "Share of completions flagged as refusals.", "{:.2f}", *_ALL),
    _m(
        "refusal_share_of_harmful",
        "refus|harm",
        "Of the completions with harm ≥ 0.5, the share flagged as refusals.",
        "{:.2f}",
        LOG,
    ),
    _m(
        "kl_base_mean",
        "KL base",
        "Mean per-token KL(policy ‖ base) of the completions, on the sampling distribution (the reward's KL term).",
        "{:.4f}",
        *_ALL,
    ),
    _m("kl_base_max", "KL base max", "Largest per-completion KL(policy ‖ base).", "{:.4f}"),
    _m(
        "n_truncated_texts",
        "scorer cut",
        "Completions longer than the scorer's maximum length (reward.max_length or the model's limit), scored on "
        "their beginning.",
        "{:.0f}",
    ),
    _m(
        "unscored_share",
        "unscored",
        "Share of completions the scorer gave no score (a judge's verdict it could not read): advantage 0; above "
        "reward.max_unscored_share the score stage stops.",
        "{:.3f}",
    ),
    # -- the update (UpdateStats) -------------------------------------------------------------------------------
    _m("loss", "loss", "Policy-gradient loss of the first update.", "{:.4f}"),
    _m(
        "sampler_kl",
        "KL sampler",
        "KL(sampler ‖ trainer) per token on the first update (k3 on the importance ratio); 0 when both see one "
        "distribution; an update above sampler_kl_tolerance is refused.",
        "{:.1e}",
        LOG,
        CHECK,
    ),
    _m(
        "sampler_kl_tolerance",
        "KL bound",
        "The largest sampler_kl the first update accepts: training.first_update_kl_tolerance, else derived from the "
        "dtype, the number of layers and the varentropy of the distribution the tokens were drawn from (rounding "
        "noise grows with each).",
        "{:.1e}",
        CHECK,
    ),
    _m(
        "sampler_kl_first_token",
        "KL first",
        "k3 at each row's first trained token (the first completion token), first update: a token scored in the "
        "wrong context is not divided by the row's length here.",
        "{:.1e}",
        CHECK,
    ),
    _m("sampler_kl_first_token_bound", "first bound", "The largest sampler_kl_first_token accepted.", "{:.1e}", CHECK),
    _m(
        "sampler_kl_last_token",
        "KL last",
        "k3 at each row's last trained token (the EOS where the row ended), first update: a stop token's logprob "
        "recorded wrongly shows here.",
        "{:.1e}",
        CHECK,
    ),
    _m("sampler_kl_last_token_bound", "last bound", "The largest sampler_kl_last_token accepted.", "{:.1e}", CHECK),
    _m(
        "sampler_kl_turn_boundary",
        "KL turns",
        "k3 at the first and last token of each inner turn of a dialogue, first update (NaN for single turns).",
        "{:.1e}",
        CHECK,
    ),
    _m(
        "sampler_kl_turn_boundary_bound",
        "turn bound",
        "The largest sampler_kl_turn_boundary accepted.",
        "{:.1e}",
        CHECK,
    ),
    _m(
        "sampler_kl_sequence",
        "KL seq",
        "Half the squared log-ratio summed over each sequence, mean over sequences, first update: an error that adds "
        "up along a row, where rounding noise grows as its square root.",
        "{:.1e}",
        CHECK,
    ),
    _m("sampler_kl_sequence_bound", "seq bound", "The largest sampler_kl_sequence accepted.", "{:.1e}", CHECK),
    _m(
        "varentropy",
        "varentropy",
        "Mean variance of the surprisal under the distribution the tokens were drawn from (nats²): what the "
        "first-update bounds grow with.",
        "{:.3f}",
        CHECK,
    ),
    _m("ratio_mean", "ratio", "Mean importance ratio of the first update (1 when on-policy).", "{:.4f}", LOG, TABLE),
    _m("ratio_std", "±ratio", "Sample std of the first update's importance ratio.", "{:.4f}", LOG, TABLE),
    _m("ratio_max", "ratio max", "Largest importance ratio of the first update.", "{:.4f}"),
    _m("first_ratio_abs_dev", "|ratio-1|", "Mean |ratio − 1| on the first update (trainer vs sampler)."),
    _m("clip_fraction", "clipped", "Share of tokens whose term was clipped on the first update.", "{:.3f}"),
    _m("grad_norm", "grad", "Global gradient norm before clipping.", "{:.3f}"),
    _m("entropy", "ent", "Mean per-token entropy of the sampling distribution.", "{:.3f}", *_ALL),
    _m("n_tokens", "tokens", "Completion tokens trained on.", "{:.0f}"),
    _m("n_sequences", "seqs", "Completions trained on.", "{:.0f}"),
    _m("n_dropped_groups", "dropped", "Groups left out of the update by dynamic sampling.", "{:.0f}"),
    _m("last_ratio_std", "±ratio last", "Ratio std on the last update of the batch; NaN with one update.", "{:.4f}"),
    _m(
        "staleness",
        "stale",
        "Updates between the weights that drew the batch and the trainer's at the step (training.max_staleness): 0 "
        "on-policy, held to the first-update check; 1 one step off-policy, where sampler_kl is KL(behaviour ‖ "
        "current).",
        "{:.0f}",
    ),
    _m(
        "logprob_mismatch_mean",
        "|Δlp|",
        "Mean |trainer − sampler| logprob per token on the first update: the kernels of another engine (vLLM).",
        "{:.1e}",
        SUMMARY,
    ),
    _m("logprob_mismatch_max", "|Δlp| max", "Largest |trainer − sampler| logprob of a token, first update.", "{:.1e}"),
    _m(
        "logprob_mismatch_share",
        "Δlp share",
        "Share of tokens whose |trainer − sampler| logprob exceeds training.logprob_mismatch_threshold.",
        "{:.3f}",
    ),
    _m(
        "correction_token_share",
        "corrected",
        "Share of tokens the mismatch correction truncated or masked (training.mismatch_correction); NaN when off.",
        "{:.3f}",
    ),
    _m(
        "correction_sequence_share",
        "corrected seqs",
        "Share of sequences with a token truncated or masked (sequence_mask: sequences masked); NaN when off.",
        "{:.3f}",
    ),
    _m("update_seconds", "s", "Wall time of the update.", "{:.2f}"),
    # -- the completions (RolloutStats) -------------------------------------------------------------------------
    _m("length_mean", "len", "Mean completion length in tokens.", "{:.1f}", *_ALL),
    _m("length_min", "len min", "Shortest completion.", "{:.0f}"),
    _m("length_max", "len max", "Longest completion.", "{:.0f}"),
    _m("truncated_fraction", "truncated", "Share of completions cut at sampling.max_new_tokens.", "{:.2f}"),
    _m("eos_per_response_max", "eos max", "Most end-of-turn tokens in one completion (must be ≤ 1).", "{:.0f}"),
    _m("multi_eos_responses", "multi eos", "Completions with more than one end-of-turn token.", "{:.0f}"),
    _m("header_violations", "headers", "Completions that contain chat-header tokens.", "{:.0f}"),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
ITERATION = Metric("iteration", "Iteration.", "iter", "{:d}", frozenset(_ALL))


def shown_in(view: str, with_iteration: bool = True) -> list[Metric]:
    """The metrics a view shows, in registry order (the iteration first, if asked)."""
    return ([ITERATION] if with_iteration else []) + [m for m in METRICS if view in m.views]


def iteration_metrics(*records: Any) -> dict[str, float]:
    """The metrics row of one iteration from the stages' records (dataclasses or dicts).

    Exactly the registry's names, each from exactly one record: a record that adds, lacks or repeats a name is
    an error here, not a silently missing or overwritten column.
    """
    row: dict[str, float] = {}
    for record in records:
        values = asdict(record) if is_dataclass(record) else dict(record)
        for name, value in values.items():
            if name in row:
                raise ValueError(f"metric {name!r} comes from two records")
            if name not in BY_NAME:
                raise ValueError(f"{name!r} is not a registered metric (core/metrics/registry.py)")
            row[name] = float(value)
    missing = [n for n in NAMES if n not in row]
    if missing:
        raise ValueError(f"metrics missing from the iteration's records: {missing}")
    return {n: row[n] for n in NAMES}


def log_line(iteration: int, row: Mapping[str, float]) -> str:
    """`iteration 3: reward 0.412  harm 0.398  ...`; metrics that are NaN (switched off) are left out."""
    parts = []
    for metric in shown_in(LOG, with_iteration=False):
        text = metric.format(row[metric.name])
        if text:
            parts.append(f"{metric.header} {text}")
    return f"iteration {iteration}: " + "  ".join(parts)


def table_rows(view: str, rows: Iterable[Mapping[str, float]]) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells of a view over metrics rows; a column that is NaN in every row is dropped."""
    rows = list(rows)
    metrics = [
        m
        for m in shown_in(view)
        if any(not (isinstance(r[m.name], float) and math.isnan(r[m.name])) for r in rows) or not rows
    ]
    return [m.header for m in metrics], [[m.format(r[m.name]) for m in metrics] for r in rows]
