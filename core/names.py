"""The one rule for a name that becomes part of a path: a run's name and id, and every file, part, checkpoint and
parent run a manifest or lineage record names. A name is one or more folder names joined by `/`, each of letters,
digits, `.`, `_` and `-`, starting with a letter or digit: no `..`, no absolute path, no `~`, no backslash, no
empty part. Such a name joined under a folder stays inside it, whatever wrote it (a config, a deployment parameter,
a run folder from someone else)."""

from __future__ import annotations

import re

_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")

RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit"


def is_component(name: object) -> bool:
    """One folder or file name that stays in its folder (`iter_0003`, `redteam-20260101-000000-000000`)."""
    return isinstance(name, str) and _COMPONENT.fullmatch(name) is not None


def is_relative_name(name: object) -> bool:
    """A relative path below a folder (`iter_0003/rollouts.parquet`), every part a component."""
    return isinstance(name, str) and all(is_component(part) for part in name.split("/"))
