"""Sample space, rank/micro-batch plan, look-ahead for the cache, cache need."""

from __future__ import annotations

import numpy as np
import pytest

from steadytrain.data.read.sampler import BatchPlan, Sampler, Source
from steadytrain.errors import ConfigError


def source(tokens: list[int], fp: str = "fp") -> Source:
    t = np.array(tokens, dtype=np.int64)
    return Source(fp, t, 2, t * 2)


def test_sample_space_counts_and_offsets():
    # (tokens - 1) // seq_len samples per shard; a shard too short contributes none.
    s = Sampler([source([33, 5, 48])], seq_len=16, global_batch=1, mode="sequential")
    assert s.num_samples == [2 + 0 + 2]
    refs = s.locate(np.arange(4))
    assert refs.shard.tolist() == [0, 0, 2, 2]
    assert refs.offset.tolist() == [0, 16, 0, 16]
    assert refs.sample_id.tolist() == [0, 1, 2, 3]
    # The last sample of a shard ends at its last token: offset + seq_len + 1 <= tokens.
    assert int(refs.offset[1]) + 17 <= 33


def test_positions_wrap_into_epochs_with_new_orders():
    s = Sampler([source([16 * 50 + 1])], seq_len=16, global_batch=10, seed=3)
    ids = s.locate(np.arange(150)).sample_id
    for e in range(3):
        assert np.array_equal(np.sort(ids[e * 50 : (e + 1) * 50]), np.arange(50))
    assert not np.array_equal(ids[:50], ids[50:100])


def test_order_depends_on_seed_not_on_anything_else():
    a = Sampler([source([16 * 50 + 1])], seq_len=16, global_batch=10, seed=3)
    b = Sampler([source([16 * 50 + 1])], seq_len=16, global_batch=10, seed=3)
    c = Sampler([source([16 * 50 + 1])], seq_len=16, global_batch=10, seed=4)
    k = np.arange(100)
    assert np.array_equal(a.locate(k).sample_id, b.locate(k).sample_id)
    assert not np.array_equal(a.locate(k).sample_id, c.locate(k).sample_id)
    # Mapping positions one at a time or in any chunking gives the same answer.
    one = np.concatenate([a.locate(np.array([i])).sample_id for i in range(100)])
    assert np.array_equal(one, a.locate(k).sample_id)


def test_batch_plan_slices_ranks_then_micro_batches():
    plan = BatchPlan(global_batch=12, micro_batch=2, rank=1, world_size=3)
    assert plan.micro_per_step == 2
    assert plan.positions(0, 4).tolist() == [[4, 5], [6, 7], [16, 17], [18, 19]]
    union = np.sort(
        np.concatenate([BatchPlan(12, 2, r, 3).positions(0, 2).ravel() for r in range(3)])
    )
    assert np.array_equal(union, np.arange(12))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(global_batch=10, micro_batch=1, rank=0, world_size=3),
            "does not divide global_batch",
        ),
        (
            dict(global_batch=12, micro_batch=5, rank=0, world_size=3),
            "micro_batch=5 does not divide",
        ),
        (dict(global_batch=12, micro_batch=2, rank=3, world_size=3), "rank=3 must lie"),
    ],
)
def test_batch_plan_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BatchPlan(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="random"), "shuffle='random' is not one of"),
        (dict(mode="block", mode_settings={"block_size": 0}), "block_size >= 1"),
        (dict(mode="global", mode_settings={"block_size": 4}), "takes no settings"),
        (dict(seq_len=100), "no shard with more than seq_len=100"),
        (dict(weights=[1, 2]), "2 weights for 1 datasets"),
        (dict(weights=[-1]), "weights must be positive"),
        (dict(seq_len=0), "must be >= 1"),
    ],
)
def test_sampler_errors(kwargs, match):
    args = dict(seq_len=16, global_batch=4)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        Sampler([source([50, 60])], **args)


def brute_first_use(s: Sampler, a: int, b: int, dataset: int, positions_of) -> dict[int, int]:
    first: dict[int, int] = {}
    for step in range(a, b):
        refs = s.locate(positions_of(step))
        for d, sh in zip(refs.dataset.tolist(), refs.shard.tolist(), strict=True):
            if d == dataset:
                first.setdefault(sh, step)
    return first


TOKENS = [16 * c + 1 for c in (7, 0, 12, 3, 30, 9, 1, 15, 22, 5)]


@pytest.mark.parametrize("mode", ["global", "sequential", "block"])
@pytest.mark.parametrize("weights", [None, [3, 1]])
def test_shards_for_steps_matches_brute_force(mode, weights):
    settings = {"block_size": 5, "window_blocks": 3} if mode == "block" else {}
    n = 1 if weights is None else 2
    srcs = [source(TOKENS, f"fp{i}") for i in range(n)]
    s = Sampler(srcs, 16, 12, seed=5, mode=mode, mode_settings=settings, weights=weights)
    for a, b in [(0, 4), (3, 40), (17, 18)]:
        for d in range(n):
            got = s.shards_for_steps(a, b, dataset=d)
            assert [st for st, _ in got] == sorted(st for st, _ in got)
            got = dict((sh, st) for st, sh in got)
            want = brute_first_use(s, a, b, d, lambda st: np.arange(st * 12, (st + 1) * 12))
            rank1 = dict(
                (sh, st)
                for st, sh in s.shards_for_steps(a, b, ranks=[1, 2], world_size=4, dataset=d)
            )
            want1 = brute_first_use(s, a, b, d, lambda st: np.arange(st * 12 + 3, st * 12 + 9))
            if mode == "block":  # window granularity: a superset, never later than needed
                assert set(want) <= set(got) and all(got[k] <= want[k] for k in want)
                assert set(want1) <= set(rank1)
            else:
                assert got == want
                assert rank1 == want1


def test_shards_for_steps_is_cheap_for_huge_ranges():
    # 11T tokens of seq 4096 in 1B-token shards: a million steps of look-ahead.
    srcs = [source([10**9] * 11_000)]
    for mode in ("sequential", "block", "global"):
        s = Sampler(srcs, 4096, 576, mode=mode)
        out = s.shards_for_steps(1_000_000, 2_000_000)
        assert out and out[0][0] == 1_000_000
        assert len({sh for _, sh in out}) == len(out)


def test_block_cache_need_bounds_every_window_pair():
    srcs = [source(TOKENS)]
    s = Sampler(srcs, 16, 4, mode="block", mode_settings={"block_size": 5, "window_blocks": 2})
    need = s.cache_need()
    win = need["window_samples"]
    assert win == 10
    refs = s.locate(np.arange(3 * s.num_samples[0]))
    for start in range(0, refs.shard.size - 2 * win, win):
        touched = np.unique(refs.shard[start : start + 2 * win])
        assert touched.size <= need["cache_need_shards"]
    g = Sampler(srcs, 16, 4, mode="global").cache_need()
    assert g["cache_need_shards"] == 9  # every shard holding a sample
    q = Sampler(srcs, 16, 4, mode="sequential").cache_need()
    assert q["cache_need_shards"] == 2
