"""The update's bound on the age of the weights that drew its rows (core/training/staleness.py)."""

import re

import pytest

from redteam_grpo.core.training.staleness import StaleRolloutsError, check_staleness


def test_rows_drawn_by_the_weights_the_update_starts_from_pass():
    check_staleness([4, 4, 4], iteration=5, max_staleness=0)
    check_staleness([-1, -1], iteration=0, max_staleness=0)  # the first iteration: the initial checkpoint
    check_staleness([], iteration=3, max_staleness=0)


@pytest.mark.parametrize(("versions", "named"), [([4, 3, 4], "[3]"), ([5], "[5]"), ([-1, 4], "[-1]")])
def test_rows_drawn_by_older_or_newer_weights_are_refused_naming_them(versions, named):
    with pytest.raises(StaleRolloutsError, match=rf"adapter version\(s\) {re.escape(named)}.*by version 4 alone"):
        check_staleness(versions, iteration=5, max_staleness=0, what="rollouts")


def test_a_bound_of_one_admits_the_weights_one_update_older_and_no_older():
    check_staleness([3, 4], iteration=5, max_staleness=1)
    with pytest.raises(StaleRolloutsError, match=r"\[2\].*versions 3\.\.4"):
        check_staleness([2, 3, 4], iteration=5, max_staleness=1)
    with pytest.raises(ValueError, match="0 or more"):
        check_staleness([4], iteration=5, max_staleness=-1)


def test_a_role_restarted_from_its_initial_checkpoint_trains_on_rows_of_those_weights_alone():
    """A mode that restarts a role (storage/modes.py: Mode.restarts) starts its update from the initial checkpoint
    (-1), not from the weights after iteration - 1: rows drawn by those are refused, and rows drawn by the initial
    checkpoint are on-policy (staleness 0), not `iteration` updates stale."""
    from redteam_grpo.core.training.staleness import staleness_of

    check_staleness([-1, -1], iteration=5, max_staleness=0, starts_from=-1)
    with pytest.raises(StaleRolloutsError, match=r"\[4\].*by version -1 alone"):
        check_staleness([4], iteration=5, max_staleness=0, starts_from=-1)
    assert staleness_of(-1, 5, starts_from=-1) == 0
    assert staleness_of(-1, 5) == 5
    # a role that starts from the weights after iteration - 1, named explicitly, keeps the whole window of its bound
    check_staleness([3, 4], iteration=5, max_staleness=1, starts_from=4)
