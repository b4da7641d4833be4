import math
from dataclasses import dataclass

import pytest

from redteam_grpo.core.metrics.registry import (
    LOG,
    METRICS,
    NAMES,
    TABLE,
    iteration_metrics,
    log_line,
    shown_in,
    table_rows,
)


def _row(**overrides):
    row = {name: 0.5 for name in NAMES}
    row.update(overrides)
    return row


def test_names_are_unique_and_both_kls_are_named_apart():
    assert len(NAMES) == len(set(NAMES)) == len(METRICS)
    assert len({m.header for m in METRICS}) == len(METRICS)
    assert "kl_base_mean" in NAMES and "sampler_kl" in NAMES
    assert not any(m.header == "KL" for m in METRICS)


def test_a_record_may_not_add_lack_or_repeat_a_metric():
    @dataclass
    class Part:
        reward_mean: float

    rest = {n: 1.0 for n in NAMES if n != "reward_mean"}
    assert iteration_metrics(Part(0.25), rest)["reward_mean"] == 0.25
    with pytest.raises(ValueError, match="missing"):
        iteration_metrics(rest)
    with pytest.raises(ValueError, match="comes from two records"):
        iteration_metrics(Part(0.25), Part(0.5), rest)
    with pytest.raises(ValueError, match="'kl_mean' is not a registered metric"):
        iteration_metrics(Part(0.25), rest, {"kl_mean": 0.1})


def test_a_term_that_is_switched_off_is_not_shown_as_nan():
    line = log_line(3, _row(novelty_mean=math.nan))
    assert line.startswith("iteration 3: reward 0.500") and "nan" not in line and "nov" not in line
    assert "nov 0.500" in log_line(3, _row())
    headers, cells = table_rows(TABLE, [{"iteration": 0, **_row(entropy=math.nan)}])
    assert "ent" not in headers and all("nan" not in c for c in cells[0])


def test_every_view_reads_the_registry():
    assert [m.name for m in shown_in(LOG, with_iteration=False)][:3] == [
        "reward_mean",
        "harm_mean",
        "repetition_mean",
    ]
    headers, cells = table_rows(TABLE, [{"iteration": 7, **_row()}])
    assert headers[0] == "iter" and cells[0][0] == "7"
    assert len(headers) == 10  # fits an 80-column terminal
