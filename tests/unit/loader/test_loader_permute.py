"""Property tests: every order is a bijection of [0, n), for arbitrary n and seeds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from steadytrain.data.read.blend import Blend, quantise_weights
from steadytrain.data.read.modes import make_order
from steadytrain.data.read.permute import Feistel

SEEDS = st.integers(min_value=0, max_value=2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=5000), key=SEEDS)
def test_feistel_is_a_bijection(n, key):
    out = Feistel(n, key)(np.arange(n))
    assert np.array_equal(np.sort(out), np.arange(n))


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=2**40, max_value=2**62), key=SEEDS, data=st.data())
def test_feistel_large_n_stays_in_range_and_is_injective(n, key, data):
    # Exhaustive checks are impossible at this size: values stay in range and distinct
    # positions never collide; the permutation of [0, 4**h) is invertible by construction.
    start = data.draw(st.integers(min_value=0, max_value=n - 1000))
    out = Feistel(n, key)(np.arange(start, start + 1000))
    assert out.min() >= 0 and out.max() < n
    assert np.unique(out).size == 1000


def test_feistel_depends_on_key_and_shuffles():
    a, b = Feistel(1000, 1)(np.arange(1000)), Feistel(1000, 2)(np.arange(1000))
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(1000))
    # Shapes are kept and a scalar works.
    assert Feistel(1000, 1)(np.arange(6).reshape(2, 3)).shape == (2, 3)
    assert int(Feistel(1000, 1)(5)) == a[5]


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=3000),
    key=SEEDS,
    epoch=st.integers(min_value=0, max_value=10**6),
    block=st.integers(min_value=1, max_value=50),
    window=st.integers(min_value=1, max_value=9),
)
def test_block_order_is_a_bijection(n, key, epoch, block, window):
    order = make_order("block", n, key, {"block_size": block, "window_blocks": window})
    out = order.ids(np.arange(n), epoch)
    assert np.array_equal(np.sort(out), np.arange(n))


def test_block_order_reads_only_the_windows_blocks():
    n, block, window = 10_000, 16, 4
    order = make_order("block", n, 3, {"block_size": block, "window_blocks": window})
    ids = order.ids(np.arange(n), 0)
    per_window = block * window
    for w in range(n // per_window):
        blocks = np.unique(ids[w * per_window : (w + 1) * per_window] // block)
        assert blocks.size == window  # W whole blocks, however they are shuffled inside


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=1, max_value=3000), key=SEEDS, epoch=st.integers(0, 50))
def test_global_order_rekeys_per_epoch(n, key, epoch):
    order = make_order("global", n, key, {})
    a, b = order.ids(np.arange(n), epoch), order.ids(np.arange(n), epoch + 1)
    assert np.array_equal(np.sort(a), np.arange(n)) and np.array_equal(np.sort(b), np.arange(n))
    if n > 8:
        assert not np.array_equal(a, b)


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=7))
def test_blend_is_exact_per_period_and_invertible(counts):
    blend = Blend(counts)
    k = np.arange(blend.period * 3 + 7)
    d, j = blend.assign(k)
    depth = max(1, int(np.ceil(np.log2(len(counts))))) if len(counts) > 1 else 1
    for ds, c in enumerate(counts):
        mine = np.flatnonzero(d == ds)
        assert np.array_equal(j[mine], np.arange(mine.size))  # each stream read in order
        assert np.array_equal(blend.position_of(ds, np.arange(mine.size)), mine)
        assert int((d[: blend.period] == ds).sum()) == c  # exact in every period
        assert int((d[blend.period : 2 * blend.period] == ds).sum()) == c
        prefix = np.cumsum(d == ds)
        ideal = (k + 1) * c / blend.period
        assert np.abs(prefix - ideal).max() < depth + 1e-9
        for kk in (0, 1, 5, blend.period, len(k)):
            assert blend.count_before(ds, kk) == int((d[:kk] == ds).sum())


def test_two_way_blend_within_one_sample_everywhere():
    blend = Blend(quantise_weights([0.7, 0.3]))
    d, _ = blend.assign(np.arange(50_000))
    prefix = np.cumsum(d == 0)
    assert np.abs(prefix - np.arange(1, 50_001) * 0.7).max() < 1


def test_quantise_weights():
    assert quantise_weights([3, 1]) == [3, 1]
    assert quantise_weights([6, 2]) == [3, 1]
    assert quantise_weights([0.7, 0.2, 0.1]) == [7000, 2000, 1000]
    assert sum(quantise_weights([1 / 3] * 3)) == 10_000
    assert quantise_weights([0.99999, 0.00001], period=100) == [99, 1]
