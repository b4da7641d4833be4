"""How an iteration's prompts split into shards (runtime.shards): contiguous runs of prompts, sizes within one.

A shard holds whole prompts, so a GRPO group (the G completions of one prompt) is never split across shards, and
its rows are a function of (run seed, iteration, shard): the same whichever worker, or how many, computed them.
"""

from __future__ import annotations

from redteam_grpo.core.seeds import derive_seed


def shard_span(n_items: int, shards: int, shard: int) -> range:
    """The items of `shard` (0-based) when `n_items` are split into `shards` contiguous runs, the first
    `n_items % shards` one longer.

    >>> [list(shard_span(5, 2, k)) for k in range(2)]
    [[0, 1, 2], [3, 4]]
    >>> [len(shard_span(8, 3, k)) for k in range(3)]
    [3, 3, 2]
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards} does not exist")
    if shards > n_items:
        raise ValueError(f"{n_items} items cannot fill {shards} shards: lower runtime.shards")
    size, longer = divmod(n_items, shards)
    start = shard * size + min(shard, longer)
    return range(start, start + size + (shard < longer))


def shard_seed(seed: int, label: str, iteration: int, shard: int, shards: int) -> int:
    """The seed of one shard's draws: a function of the run seed, the stage, the iteration and the shard only. One
    shard is the whole stage and keeps the stage's seed.

    >>> shard_seed(0, "sample", 3, 1, 2) == shard_seed(0, "sample", 3, 1, 2) != shard_seed(0, "sample", 3, 0, 2)
    True
    >>> shard_seed(0, "sample", 3, 0, 1) == derive_seed(0, "sample", 3)
    True
    """
    if shards == 1:
        return derive_seed(seed, label, iteration)
    return derive_seed(seed, label, iteration, "shard", shard)
