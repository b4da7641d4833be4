"""The Parquet contract between stages: one explicit pyarrow schema per stage file, checked on read.

These schemas are the one source of truth for column names: writers build tables from them and readers validate against
them, so a renamed, missing or mistyped column is an error naming it, never a column of silent zeros (bug class
`renamed-column-reads-as-zeros`, docs/bug-classes.md). Every per-completion row carries run_id, iteration, prompt_id,
sample_idx.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from redteam_grpo.core.metrics.registry import NAMES as METRIC_NAMES
from redteam_grpo.storage.location import is_remote

KEY_FIELDS = [
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("iteration", pa.int32(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_idx", pa.int32(), nullable=False),
]
KEY_COLUMNS = [f.name for f in KEY_FIELDS]

ROLLOUTS = pa.schema(
    [
        *KEY_FIELDS,
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),  # exactly as fed to the sampler
        pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),  # exactly as sampled
        pa.field("sampling_logprobs", pa.list_(pa.float32()), nullable=False),  # one per completion token
        pa.field("completion_text", pa.string(), nullable=False),  # decoded, special tokens skipped
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length"
        pa.field("completion_length", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int32(), nullable=False),  # iteration whose update made the weights; -1 = init
        pa.field("sampling_seed", pa.int64(), nullable=False),
        pa.field("temperature", pa.float32(), nullable=False),
        # dialogue.turns > 1: one row per sampled message; the exchange it belongs to and who sampled it
        pa.field("turn", pa.int32(), nullable=False),  # 0: the answer to the prompt
        pa.field("speaker", pa.string(), nullable=False),  # "policy" | "attacker"
    ]
)

# The judge stage: what the scorer read from the text alone, which no weights of the policy change (harm, categories,
# refusal, novelty), so it can be computed beside the update before (training.max_staleness); the score stage copies
# these columns into SCORES beside the terms that need the policy.
JUDGEMENT_FIELDS = [
    pa.field("harm", pa.float64(), nullable=True),  # null: the scorer gave no score
    pa.field("scorer_name", pa.string(), nullable=False),
    pa.field("scorer_revision", pa.string(), nullable=False),
    pa.field("scorer_kind", pa.string(), nullable=False),  # classifier | judge
    pa.field("categories", pa.list_(pa.string()), nullable=False),  # a judge's hazard codes, e.g. ["S10"]
    pa.field("refusal", pa.bool_(), nullable=False),  # the completion opens as a refusal
    pa.field("scorer_truncated", pa.bool_(), nullable=False),  # the scorer read only the text's beginning
    pa.field("novelty", pa.float64(), nullable=True),  # null when reward.novelty_weight is 0
    pa.field("embedding", pa.list_(pa.float32()), nullable=True),  # unit norm; later iterations' novelty memory
]
JUDGEMENTS = pa.schema(
    [
        *KEY_FIELDS,
        *JUDGEMENT_FIELDS,
        # dialogues: each policy answer's harm in the conversation up to it (the last is `harm`); null for
        # single-turn rows and when not computed
        pa.field("turn_harm", pa.list_(pa.float64()), nullable=True),
    ]
)

SCORES = pa.schema(
    [
        *KEY_FIELDS,
        *JUDGEMENT_FIELDS,  # the judge stage's, copied (attack_scores: the judge's of the defender's responses)
        pa.field("repetition_ratio", pa.float64(), nullable=False),
        # log-probabilities of the sampled tokens under the sampling distribution (temperature, suppressed tokens),
        # both from the trainer's forward (adapter on, adapter off), not the sampler's (rollouts keep those)
        pa.field("policy_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reference_logprobs", pa.list_(pa.float32()), nullable=False),  # the same, adapter off
        pa.field("kl", pa.float64(), nullable=False),  # mean per-token k3 KL(policy || base) on that distribution
        # mean per-token entropy of the policy there
        pa.field("entropy", pa.float64(), nullable=False),
        pa.field("reward", pa.float64(), nullable=True),  # null when harm is null
        # dialogues: each policy answer's harm in the conversation up to it (the last is `harm`) and, with
        # dialogue.rewards=per_turn, each turn's reward; null for single-turn rows and when not computed
        pa.field("turn_harm", pa.list_(pa.float64()), nullable=True),
        pa.field("turn_rewards", pa.list_(pa.float64()), nullable=True),
    ]
)

ADVANTAGES = pa.schema(
    [
        *KEY_FIELDS,
        pa.field("reward", pa.float64(), nullable=True),
        pa.field("advantage", pa.float64(), nullable=False),
        # dialogue.rewards=per_turn: the advantage of each policy turn, for the tokens of that turn; null otherwise
        pa.field("turn_advantages", pa.list_(pa.float64()), nullable=True),
    ]
)

# Active Attacks (run.mode=active): one row per iteration, whether or not it hardened the victim.
HARDEN_METRICS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("hardened", pa.bool_(), nullable=False),  # the victim was tuned at the end of this iteration
        pa.field("attacks_found", pa.int64()),  # distinct found attacks so far; null: not a round's last iteration
        pa.field("train_loss", pa.float64(), nullable=False),  # mean per refusal token, last pass; NaN: no tuning
        pa.field("train_tokens", pa.int64(), nullable=False),
        pa.field("steps", pa.int64(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
    ]
)

# SFT (run.mode=sft): one row per epoch.
SFT_METRICS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),  # the epoch
        pa.field("train_loss", pa.float64(), nullable=False),  # mean per target token over the epoch
        pa.field("eval_loss", pa.float64(), nullable=False),  # mean per target token on the held-out pairs; NaN: none
        pa.field("train_tokens", pa.int64(), nullable=False),
        pa.field("eval_tokens", pa.int64(), nullable=False),
        pa.field("steps", pa.int64(), nullable=False),
        pa.field("grad_norm_mean", pa.float64(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
    ]
)

# One row per iteration: exactly the metrics registry (core/metrics/registry.py), which names and describes each column.
TRAIN_METRICS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        *(pa.field(name, pa.float64(), nullable=False) for name in METRIC_NAMES),
    ]
)

# The columns every evaluation row of an answer has: who answered what (tasks/cross_target.py: `Answer.columns`), and
# the scorer that read it.
ANSWER_FIELDS = [
    pa.field("target", pa.string(), nullable=False),  # the model that answered (hub id, folder, embedded:*)
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_idx", pa.int32(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
]
SCORER_FIELDS = [
    pa.field("scorer_name", pa.string(), nullable=False),
    pa.field("scorer_revision", pa.string(), nullable=False),
    # a judge's format (core/scoring/judge_formats.py), or "classifier": two evaluations compare only when the
    # scorer, its format and its revision are the same
    pa.field("scorer_format", pa.string(), nullable=False),
]

# `redteam-grpo` evaluation (flows/evaluate.py): one row per completion, of the base and of a checkpoint's adapter.
EVALUATION = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string(), nullable=False),  # the adapter evaluated: "init" | "iter_0003"
        # "base" (adapter off) | "adapter" | a transfer target's model name
        pa.field("policy", pa.string(), nullable=False),
        # "held_out" (prompts the run did not train on) | "benign" (over-refusal) | "transfer" (the adapter's
        # successful held-out prompts, answered by each target)
        pa.field("set", pa.string(), nullable=False),
        *ANSWER_FIELDS,
        pa.field("completion_text", pa.string(), nullable=False),
        pa.field("harm", pa.float64(), nullable=True),
        pa.field("refusal", pa.bool_(), nullable=False),
        pa.field("categories", pa.list_(pa.string()), nullable=False),
        *SCORER_FIELDS,
        pa.field("success", pa.bool_(), nullable=False),  # harm >= threshold and not a refusal
    ]
)

# `redteam-grpo evaluate` of a defense run (tasks/evaluate_defense.py): one row per answer, of the base and of the
# defended adapter on each set, and of each transfer target on the adversarial examples.
DEFENSE_EVALUATION = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("checkpoint", pa.string(), nullable=False),  # the defender's adapter evaluated: "iter_0003"
        pa.field("policy", pa.string(), nullable=False),  # "base" | "defended" | a transfer target's model name
        # "heldout_goals" (the attacker's prompts for held-out goals) | "prompt_file" | "benign" (over-refusal) |
        # "transfer" (the attacks the base answered unsafely, answered by each target)
        pa.field("set", pa.string(), nullable=False),
        *ANSWER_FIELDS,
        pa.field("response", pa.string(), nullable=False),
        pa.field("harm", pa.float64(), nullable=True),  # null: the scorer gave no score
        pa.field("unsafe", pa.bool_(), nullable=False),  # harm >= the success threshold
        pa.field("refusal", pa.bool_(), nullable=False),
        pa.field("kl_to_base", pa.float64(), nullable=False),  # the defended adapter's benign answers; NaN elsewhere
        *SCORER_FIELDS,
    ]
)

# An attacker's prompts in an evaluation (Active Attacks: each attacker of its tables), one row per prompt: what the
# victims answer, kept as a part of the evaluation (storage/evaluation_parts.py) so that a resumed one answers the same.
EVALUATION_ATTACKS = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),  # "<goal id>#<prompt of the goal>"
        pa.field("goal", pa.string(), nullable=False),  # what it was written for, which the judge is told
        pa.field("attack", pa.string(), nullable=False),
    ]
)

# The summary beside every evaluation's rows (`summary-<rows file>`): one long table, what `report` shows.
EVALUATION_SUMMARY = pa.schema(
    [
        ("policy", pa.string()),  # a policy of the run, "checks", or a transfer target's model name
        ("metric", pa.string()),
        ("tau", pa.float64()),
        ("value", pa.float64()),
        ("judge", pa.string()),  # the scorer behind an attack-success or refusal figure (`judge_label`), else null
    ]
)


class SchemaError(ValueError):
    """A Parquet file does not match its stage's schema."""


def check_schema(actual: pa.Schema, expected: pa.Schema, what: str) -> None:
    problems = []
    for field in expected:
        if field.name not in actual.names:
            problems.append(f"missing column {field.name!r} ({field.type})")
        elif not actual.field(field.name).type.equals(field.type):
            problems.append(f"column {field.name!r} is {actual.field(field.name).type}, expected {field.type}")
    problems += [f"unexpected column {name!r}" for name in actual.names if name not in expected.names]
    if problems:
        raise SchemaError(f"{what} does not match its schema: " + "; ".join(problems))


def to_table(rows: dict[str, list], schema: pa.Schema, what: str) -> pa.Table:
    """Columns (name -> values) to a table of exactly `schema`; missing or extra names are errors."""
    missing = [n for n in schema.names if n not in rows]
    extra = [n for n in rows if n not in schema.names]
    if missing or extra:
        raise SchemaError(f"{what}: missing columns {missing}, unexpected columns {extra}")
    table = pa.table({n: rows[n] for n in schema.names}, schema=schema)
    for field in schema:
        if not field.nullable and table.column(field.name).null_count:
            raise SchemaError(f"{what}: column {field.name!r} has nulls but is not nullable")
    return table


def rows_to_table(rows: list[dict], schema: pa.Schema, what: str) -> pa.Table:
    """Rows (one dict each, all with the same keys) to a table of exactly `schema`; a row whose keys differ from the
    first's, or a key missing from or beyond the schema, is an error naming it."""
    names = list(rows[0]) if rows else schema.names
    for i, r in enumerate(rows):
        if r.keys() != set(names):
            raise SchemaError(
                f"{what}: row {i} lacks {sorted(set(names) - r.keys())} and adds {sorted(r.keys() - set(names))}"
            )
    return to_table({k: [r[k] for r in rows] for k in names}, schema, what)


def read_schema(path: Path) -> pa.Schema:
    """The schema a Parquet file declares (a local one, or one on a store reached through fsspec)."""
    return pq.read_schema(path.path, filesystem=path.fs) if is_remote(path) else pq.read_schema(path)


def read_table(path: Path, schema: pa.Schema) -> pa.Table:
    """Read a stage file, checking its schema before any value is used."""
    if not path.is_file():
        raise SchemaError(f"{path} does not exist: the stage that writes it has not completed")
    try:
        table = pq.read_table(path.path, filesystem=path.fs) if is_remote(path) else pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SchemaError(f"{path} is not a readable Parquet file ({exc}); delete it to recompute its stage") from None
    check_schema(table.schema, schema, str(path))
    return table
