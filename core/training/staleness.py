"""Which rollouts an update may train on: those drawn by weights at most `max_staleness` updates old.

Every rollouts row records the version of the adapter that drew it (the iteration whose update made the weights,
-1 for the initial checkpoint), read off the weights the sampler held, not computed from the iteration. The update of
iteration i starts from the weights after i - 1; a row drawn by those is on-policy, one drawn by i - 1 - k is k updates
stale. The synchronous pipeline trains on-policy rows alone (max_staleness 0). A row drawn by older weights than the
bound is one whose logprobs the ratio's correction was not made for (bug class `stale-rollouts-trained-on`,
docs/bug-classes.md); one drawn by newer weights than the update starts from cannot have been drawn by this run's
history at all.

With one step off-policy (max_staleness 1) iteration i is drawn by the weights after i - 1 - max_staleness
(`drawing_version`) while the update of i - 1 runs: a rule of the iteration alone, so a resumed run draws each
iteration with the weights an uninterrupted one drew it with.
"""

from __future__ import annotations

from collections.abc import Iterable

INITIAL_VERSION = -1  # the initial checkpoint's version: no update made its weights


class StaleRolloutsError(ValueError):
    pass


def drawing_version(iteration: int, max_staleness: int) -> int:
    """The version of the weights that draw iteration `iteration`'s rollouts: those after iteration
    iteration - 1 - max_staleness, the initial checkpoint's before any exist.

    >>> [drawing_version(i, 0) for i in range(4)], [drawing_version(i, 1) for i in range(4)]
    ([-1, 0, 1, 2], [-1, -1, 0, 1])
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be 0 or more, got {max_staleness}")
    return max(iteration - 1 - max_staleness, INITIAL_VERSION)


def staleness_of(version: int, iteration: int, starts_from: int | None = None) -> int:
    """How many updates older than the weights iteration `iteration`'s update starts from (those after iteration - 1,
    or `starts_from`) the weights of `version` are."""
    return (iteration - 1 if starts_from is None else starts_from) - version


def check_staleness(
    versions: Iterable[int], iteration: int, max_staleness: int, what: str = "rollouts", starts_from: int | None = None
) -> None:
    """Refuse rows for iteration `iteration`'s update whose adapter version lies outside
    [newest - max_staleness, newest], newest being the version the update starts from: `starts_from` where given (a
    role restarted from its initial checkpoint: -1), else iteration - 1."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be 0 or more, got {max_staleness}")
    newest = iteration - 1 if starts_from is None else starts_from
    oldest = newest - max_staleness
    drawn = sorted(set(versions))
    outside = [v for v in drawn if not oldest <= v <= newest]
    if outside:
        bound = f"version {newest}" if max_staleness == 0 else f"versions {oldest}..{newest}"
        raise StaleRolloutsError(
            f"{what} of iteration {iteration} hold rows drawn by adapter version(s) {outside}; its update may train "
            f"on rows drawn by {bound} alone (-1: the initial checkpoint). They were sampled with other weights than "
            "the update's ratio assumes: sample the iteration again"
        )
