"""Staging (pre-warming a node's cache) and the preflight check a run does at start.

``stage`` fetches the whole dataset, or exactly the shards a step range needs, verifies
every staged file against the manifest and reports bytes, seconds and GB/s: a spare node
staged this way starts training without a single remote read. ``preflight`` answers, at
training start, whether the cache already holds what the first steps need.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from steadytrain.storage.cache import ShardCache
from steadytrain.storage.prefetch import Schedule, first_uses

__all__ = ["stage", "preflight"]


def stage(
    cache: ShardCache,
    *,
    schedule: Schedule | None = None,
    steps: tuple[int, int] | None = None,
    workers: int = 4,
) -> dict[str, Any]:
    """Fetch and verify the shards of ``steps`` (all shards if None). Returns a report."""
    n = cache.num_shards
    if steps is None or schedule is None:
        shards = list(range(n))
    else:
        uses = first_uses(schedule(steps[0], steps[1]))
        shards = sorted(uses, key=lambda s: (uses[s], s))
    before = cache.metrics()["bytes_fetched"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(cache.ensure_shard, shards))
    fetch_s = time.perf_counter() - t0
    fetched = cache.metrics()["bytes_fetched"] - before
    total = sum(cache.shard_bytes(s) for s in shards)
    seconds = time.perf_counter() - t0
    return {
        "dataset": cache.store.url,
        "cache_dir": cache.cache_dir,
        "cache_root": cache.root,
        "fingerprint": cache.namespace,
        "steps": list(steps) if steps is not None else None,
        "shards": len(shards),
        "bytes": total,
        "bytes_fetched": fetched,
        "bytes_already_cached": total - fetched,
        "seconds": seconds,
        "fetch_seconds": fetch_s,
        "gbps": (fetched / fetch_s / 1e9) if fetch_s > 0 else 0.0,
        "verified": True,
        "verify": cache.verify,
    }


def preflight(
    cache: ShardCache, schedule: Schedule, steps: int, *, start_step: int = 0
) -> dict[str, Any]:
    """Does the cache hold every shard steps ``[start_step, start_step + steps)`` read?

    ``ready_steps`` is how many leading steps are covered; ``missing_bytes`` what would be
    fetched on demand. Size checks only: it costs a ``stat`` per file.
    """
    pairs = schedule(start_step, start_step + steps)
    uses = first_uses(pairs)
    missing = sorted(s for s in uses if not cache.shard_cached(s))
    first_missing = min((uses[s] for s in missing), default=start_step + steps)
    return {
        "ready": not missing,
        "steps": steps,
        "start_step": start_step,
        "ready_steps": first_missing - start_step,
        "shards_needed": len(uses),
        "missing_shards": missing,
        "missing_bytes": sum(cache.shard_bytes(s) for s in missing),
    }
