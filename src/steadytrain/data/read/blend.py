"""Closed-form blending of several datasets: which dataset serves stream position ``k``.

Weights become integer counts ``c_d`` per period ``P = sum(c_d)``. The datasets are split
recursively into two groups (a balanced binary tree); at a node whose left group has count
``a`` out of ``T``, position ``k`` of the node's stream goes left iff

    floor((k + 1) a / T) > floor(k a / T)          (a Bresenham / Beatty sequence)

and becomes position ``floor(k a / T)`` of the left stream, else ``k - floor(k a / T)`` of
the right stream. Consequences, all without any per-sample array:

* over every period of ``P`` positions dataset ``d`` serves exactly ``c_d`` of them, and at
  any prefix its count differs from ``k c_d / P`` by less than the tree depth
  (``ceil(log2 D)``; under one sample for two datasets);
* ``count_before(d, k)`` (how many of ``[0, k)`` go to ``d``) and its inverse
  ``position_of(d, j)`` (where ``d``'s ``j``-th sample sits) are O(depth) integer formulas,
  which is what resume and the cache's look-ahead need.

Integer work is reduced modulo the node's period first, so nothing overflows int64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from steadytrain.errors import ConfigError

__all__ = ["Blend", "quantise_weights"]

DEFAULT_PERIOD = 10_000
MAX_PERIOD = 1 << 20


def quantise_weights(weights: Sequence[float], period: int | None = None) -> list[int]:
    """Integer counts per period for ``weights``.

    Integral weights with a small sum are used as they are (reduced by their gcd), so
    ``[3, 1]`` means exactly 3 of every 4 samples. Otherwise counts are the largest-remainder
    rounding of the normalised weights to ``period`` (default 10,000), each at least 1.
    """
    if not weights:
        raise ConfigError("blending needs at least one dataset weight")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise ConfigError(f"weight {i} is {w!r}: weights must be positive finite numbers")
    if period is None and all(float(w).is_integer() for w in weights):
        ints = [int(w) for w in weights]
        g = math.gcd(*ints)
        ints = [w // g for w in ints]
        if sum(ints) <= MAX_PERIOD:
            return ints
    period = DEFAULT_PERIOD if period is None else int(period)
    if not len(weights) <= period <= MAX_PERIOD:
        raise ConfigError(
            f"blend period {period} must lie in [{len(weights)}, {MAX_PERIOD}] (one slot per dataset)"
        )
    total = sum(Fraction(w) for w in weights)
    exact = [Fraction(w) / total * period for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    # Largest remainder: hand out (or take back) the difference one sample at a time.
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    i = 0
    while sum(counts) < period:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > period:
        j = max(range(len(counts)), key=lambda d: (counts[d] - exact[d], -d))
        counts[j] -= 1
    return counts


class _Node:
    __slots__ = ("lo", "hi", "left", "right", "a", "t")

    def __init__(self, counts: Sequence[int], lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.t = sum(counts[lo:hi])
        self.left = self.right = None
        self.a = 0
        if hi - lo > 1:
            mid = (lo + hi) // 2
            self.left, self.right = _Node(counts, lo, mid), _Node(counts, mid, hi)
            self.a = self.left.t


class Blend:
    """Weighted interleave of ``len(counts)`` infinite streams, in closed form."""

    def __init__(self, counts: Sequence[int]) -> None:
        if not counts or min(counts) < 1:
            raise ConfigError(f"blend counts must be positive integers, got {list(counts)}")
        self.counts = [int(c) for c in counts]
        self.period = sum(self.counts)
        self._root = _Node(self.counts, 0, len(self.counts))

    @property
    def num_streams(self) -> int:
        return len(self.counts)

    def assign(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, position within that dataset's stream) for each global position."""
        k = np.asarray(positions, dtype=np.int64)
        dataset = np.zeros(k.shape, dtype=np.int64)
        local = k.copy()
        if len(self.counts) > 1:
            self._assign(self._root, np.arange(k.size), k.ravel(), dataset.ravel(), local.ravel())
        return dataset, local

    def _assign(
        self, node: _Node, idx: np.ndarray, k: np.ndarray, out_d: np.ndarray, out_j: np.ndarray
    ) -> None:
        if node.left is None:
            out_d[idx] = node.lo
            out_j[idx] = k
            return
        m, p = np.divmod(k, node.t)
        before = m * node.a + (p * node.a) // node.t  # left positions among [0, k)
        is_left = m * node.a + ((p + 1) * node.a) // node.t > before
        self._assign(node.left, idx[is_left], before[is_left], out_d, out_j)
        right = ~is_left
        self._assign(node.right, idx[right], (k - before)[right], out_d, out_j)

    def count_before(self, d: int, k: int) -> int:
        """How many of the global positions ``[0, k)`` dataset ``d`` serves."""
        node = self._root
        while node.left is not None:
            m, p = divmod(k, node.t)
            lefts = m * node.a + (p * node.a) // node.t
            if d < node.left.hi:
                node, k = node.left, lefts
            else:
                node, k = node.right, k - lefts
        return k

    def position_of(self, d: int, j: np.ndarray | int) -> np.ndarray:
        """Inverse of ``assign``: the global position of dataset ``d``'s ``j``-th sample."""
        j = np.asarray(j, dtype=np.int64)
        path = []
        node = self._root
        while node.left is not None:
            went_left = d < node.left.hi
            path.append((node, went_left))
            node = node.left if went_left else node.right
        for node, went_left in reversed(path):
            if went_left:  # smallest k with floor((k+1) a / T) >= j + 1
                m, r = np.divmod(j + 1, node.a)
                j = m * node.t + (r * node.t + node.a - 1) // node.a - 1
            else:  # smallest k with ceil((k+1) b / T) >= j + 1, b = T - a
                b = node.t - node.a
                m, r = np.divmod(j, b)
                j = m * node.t + (r * node.t) // b
        return j
