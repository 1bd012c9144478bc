"""The shard schedule of a run: which shards the steps ``[a, b)`` read, in step order.

The data order is a pure function of the run settings (DESIGN invariant 1), so the storage
layer's prefetcher and ``stage`` can be told the future. They take any callable
``schedule(a, b) -> [(step, shard), ...]`` (``steadytrain.storage.prefetch.Schedule``);
this module builds one from the sampler, which is why it lives on the data side.
"""

from __future__ import annotations

from typing import Any

from steadytrain.data.read.sampler import Sampler
from steadytrain.storage.prefetch import Schedule

__all__ = ["schedule_for_run"]


def schedule_for_run(
    ds: Any,
    *,
    seq_len: int,
    global_batch: int,
    seed: int = 0,
    shuffle: str = "global",
    world_size: int = 1,
    ranks: list[int] | None = None,
    shuffle_settings: dict[str, Any] | None = None,
) -> Schedule:
    """The (step, shard) schedule of a run on ``ds``: ``Sampler.shards_for_steps`` bound to
    the run settings (``ranks=None``: every rank, i.e. a cache shared by the whole job)."""

    sampler = Sampler(
        [ds], seq_len, global_batch, seed=seed, mode=shuffle, mode_settings=shuffle_settings
    )
    return lambda a, b: sampler.shards_for_steps(a, b, ranks=ranks, world_size=world_size)
