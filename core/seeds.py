"""Seeds derived from the run seed, the same in every process: a resumed stage draws what it drew before."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a label (`derive_seed(0, "sample", 3)`).

    >>> derive_seed(0, "sample", 3) == derive_seed(0, "sample", 3) != derive_seed(0, "sample", 4)
    True
    """
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
