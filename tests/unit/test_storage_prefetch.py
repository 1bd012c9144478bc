"""Schedule-aware prefetch (horizon, deadlines) and Belady eviction under a byte budget."""

from __future__ import annotations

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import open_shard_cache
from steadytrain.data.read.format import read_manifest
from steadytrain.data.read.schedule import schedule_for_run
from steadytrain.errors import ConfigError
from steadytrain.storage.prefetch import Prefetcher, first_uses, next_uses
from steadytrain.storage.stage import preflight, stage
from steadytrain.storage.store import Store


def equal_shards(dest: str, shards: int = 8) -> Store:
    """``shards`` shards of exactly 1000 tokens (10 documents of 100)."""
    rng = np.random.default_rng(1)
    with DatasetWriter(dest, vocab_size=300, eos_id=0, tokenizer={}, shard_tokens=1000) as w:
        for _ in range(shards * 10):
            w.add_document(np.append(rng.integers(1, 300, size=99), 0))
    return Store(dest)


@pytest.fixture
def cache(tmp_path):
    store = equal_shards(str(tmp_path / "src"))
    return open_shard_cache(str(tmp_path / "cache"), store, read_manifest(store))


def table_schedule(uses: dict[int, list[int]]):
    pairs = sorted((step, shard) for shard, steps in uses.items() for step in steps)
    return lambda a, b: [(s, k) for s, k in pairs if a <= s < b]


def cyclic_schedule(n_shards: int, per_step: int = 1):
    return lambda a, b: [
        (s, (s * per_step + j) % n_shards) for s in range(a, b) for j in range(per_step)
    ]


def test_first_and_next_uses():
    sched = table_schedule({0: [5, 9], 1: [2], 2: [40]})
    assert first_uses(sched(0, 10)) == {1: 2, 0: 5}
    assert next_uses(sched, {0, 1, 2, 3}, 3, window=4, limit=100) == {
        0: 5,
        1: float("inf"),
        2: 40,
        3: float("inf"),
    }


def test_prefetch_fills_the_horizon_ahead_of_use(cache):
    with Prefetcher(cache, cyclic_schedule(8), horizon_steps=4, workers=2) as pf:
        assert pf.wait_idle(timeout=30)
        assert [cache.shard_cached(s) for s in range(8)] == [True] * 4 + [False] * 4
        assert pf.ahead_steps() == 4
        pf.advance(3)
        assert pf.wait_idle(timeout=30)
        assert all(cache.shard_cached(s) for s in range(7))
        assert cache.prefetch_ahead_steps == 4
    assert cache.metrics()["downloads"] == 14  # 7 shards x (tokens + index), each once


def test_budget_that_fits_the_dataset_never_evicts(cache):
    n = cache.num_shards
    budget = sum(cache.shard_bytes(s) for s in range(n))
    with Prefetcher(cache, cyclic_schedule(n), horizon_steps=3, budget_bytes=budget) as pf:
        for step in range(0, 3 * n):
            pf.advance(step)
            assert pf.wait_idle(timeout=30)
        assert pf.evicted == []
    assert cache.metrics()["evictions"] == 0 and cache.usage_bytes() == budget


def test_belady_evicts_furthest_next_use_and_never_the_horizon(cache):
    size = cache.shard_bytes(0)
    for s in (0, 1, 2):
        cache.ensure_shard(s)
    sched = table_schedule({3: [0, 1, 60], 1: [10, 40], 0: [20, 80], 4: [29, 30]})
    with Prefetcher(cache, sched, horizon_steps=2, budget_bytes=3 * size, workers=1) as pf:
        assert pf.wait_idle(timeout=30)
        assert pf.evicted == [(0, 2)]  # shard 2 is never used again: furthest of all
        pf.advance(29)
        assert pf.wait_idle(timeout=30)
        # Needs shard 4; resident 0 (next 80), 1 (40), 3 (60): Belady drops 0.
        assert pf.evicted == [(0, 2), (29, 0)]
        assert {s for s in range(5) if cache.shard_cached(s)} == {1, 3, 4}


def test_a_published_shard_still_in_flight_is_counted_once(cache):
    """The ranks of a node each run a prefetcher over one cache: a shard another rank (or
    our other fetch thread) has just published may still sit in our in-flight set. Counting
    it twice made every rank evict one shard too many (bench/cache_peers.py caught it)."""
    size = cache.shard_bytes(0)
    for s in range(5):
        cache.ensure_shard(s)
    pf = Prefetcher(
        cache, cyclic_schedule(8), horizon_steps=2, budget_bytes=5 * size, total_steps=0
    )
    pf.close()  # total_steps=0: its threads fetched nothing; drive the planner by hand
    pf.total_steps, pf._step = None, 4
    with pf._cond:
        pf._refresh_plan()  # horizon: steps 4, 5 -> shards 4, 5
        pf._inflight = {4}  # published, its fetch not yet returned
        assert pf._make_room(size)  # room for shard 5
    assert pf.evicted == [(4, 3)]  # one shard, the furthest next use (step 11)
    assert [cache.shard_cached(s) for s in range(5)] == [True, True, True, False, True]


def test_tight_budget_waits_instead_of_evicting_the_horizon(cache):
    size = cache.shard_bytes(0)
    sched = cyclic_schedule(8, per_step=1)
    with Prefetcher(cache, sched, horizon_steps=4, budget_bytes=2 * size, workers=2) as pf:
        for step in range(12):
            pf.advance(step)
            pf.wait_idle(timeout=0.1)
            assert cache.usage_bytes() <= 2 * size
        for at_step, shard in pf.evicted:
            assert shard not in {k for _, k in sched(at_step, at_step + 4)}
        assert pf.evicted  # it did have to evict to make progress


def test_prefetcher_validates_settings(cache):
    with pytest.raises(ConfigError):
        Prefetcher(cache, cyclic_schedule(8), horizon_steps=0)
    with pytest.raises(ConfigError):
        Prefetcher(cache, cyclic_schedule(8), budget_bytes=0)


def test_stage_steps_then_preflight(cache):
    sched = cyclic_schedule(8, per_step=2)
    before = preflight(cache, sched, steps=2)
    assert before["ready"] is False and before["missing_shards"] == [0, 1, 2, 3]
    assert before["ready_steps"] == 0 and before["missing_bytes"] == 4 * cache.shard_bytes(0)
    report = stage(cache, schedule=sched, steps=(0, 2))
    assert report["shards"] == 4 and report["bytes_fetched"] == 4 * cache.shard_bytes(0)
    assert report["verified"] and report["gbps"] > 0
    after = preflight(cache, sched, steps=3)
    assert (
        after["ready"] is False and after["ready_steps"] == 2 and after["missing_shards"] == [4, 5]
    )
    assert preflight(cache, sched, steps=2)["ready"] is True
    whole = stage(cache)
    assert whole["shards"] == 8 and whole["bytes_already_cached"] == 4 * cache.shard_bytes(0)
    assert stage(cache)["bytes_fetched"] == 0


def test_schedule_for_run_uses_the_sampler(cache, tmp_path):
    from steadytrain.data.read.dataset import TokenDataset

    ds = TokenDataset.open(cache.store.url)
    sched = schedule_for_run(ds, seq_len=99, global_batch=5, shuffle="sequential")
    # 10 samples of 99 (+1) tokens per 1000-token shard: step s reads samples [5s, 5s+5).
    assert sched(0, 4) == [(0, 0), (2, 1)]
    assert first_uses(sched(0, 16)) == {s: 2 * s for s in range(8)}


def test_sparse_replanning_still_covers_the_horizon(tmp_path):
    store = equal_shards(str(tmp_path / "src"), shards=40)
    cache = open_shard_cache(str(tmp_path / "cache"), store, read_manifest(store))
    sched = cyclic_schedule(40)
    with Prefetcher(cache, sched, horizon_steps=16, workers=2) as pf:  # re-plans every 2 steps
        for step in range(0, 9):
            pf.advance(step)
            assert pf.wait_idle(timeout=30)
            assert all(cache.shard_cached(k) for _, k in sched(step, step + 16))
            assert pf.ahead_steps() >= 16
