"""A keyed bijection over ``[0, n)``: a balanced Feistel network with cycle-walking.

This is how the loader shuffles without an index (DESIGN invariant 2): position ``i`` of an
epoch maps to sample ``Feistel(n, key)(i)``, evaluated on demand for a whole batch of
positions at once with numpy ``uint64`` arithmetic. Nothing is stored but ``rounds`` keys.

Why a Feistel network: any round function gives a permutation of ``[0, 4**h)`` (each round
is invertible), so bijectivity does not depend on the quality of the mixing, only the
shuffle's randomness does. ``n`` is rarely a power of four, so values that land outside
``[0, n)`` are encrypted again ("cycle-walking") until they land inside; because the domain
is less than ``4 n``, the expected number of extra passes is below 3 and the result is still
a bijection of ``[0, n)`` (each cycle of the big permutation is walked in order).
"""

from __future__ import annotations

import numpy as np

__all__ = ["Feistel", "derive_key", "splitmix64"]

_M64 = (1 << 64) - 1
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
DEFAULT_ROUNDS = 6  # 4 is the Luby-Rackoff minimum for a pseudo-random permutation


def splitmix64(x: int) -> int:
    """One step of SplitMix64 on a Python int: a fast, well-mixed 64-bit hash."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def derive_key(*parts: int) -> int:
    """A 64-bit key from integers (seed, dataset, epoch, purpose...), order-sensitive."""
    h = 0x243F6A8885A308D3
    for part in parts:
        h = splitmix64(h ^ (int(part) & _M64))
    return h


class Feistel:
    """Permutation of ``[0, n)`` keyed by ``key``; ``f(positions) -> samples``, vectorised."""

    __slots__ = ("n", "half_bits", "_mask", "_keys")

    def __init__(self, n: int, key: int, rounds: int = DEFAULT_ROUNDS) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        if n > 1 << 62:
            raise ValueError(f"n={n} is larger than 2**62")
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1  # balanced halves
        self.n = int(n)
        self.half_bits = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(derive_key(key, r)) for r in range(rounds)]

    def _round(self, right: np.ndarray, key: np.uint64) -> np.ndarray:
        x = (right ^ key) * _C1  # wraps modulo 2**64 (arrays never warn)
        x ^= x >> np.uint64(31)
        x *= _C2
        x ^= x >> np.uint64(29)
        return x & self._mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half_bits, x & self._mask
        for key in self._keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half_bits) | right

    def __call__(self, positions: np.ndarray | int) -> np.ndarray:
        """Map positions (any integer array with values in ``[0, n)``) to int64 sample ids."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n})")
        y = self._encrypt(x.astype(np.uint64).ravel())
        outside = np.flatnonzero(y >= np.uint64(self.n))
        while outside.size:  # cycle-walk the few values that left [0, n)
            walked = self._encrypt(y[outside])
            y[outside] = walked
            outside = outside[walked >= np.uint64(self.n)]
        return y.astype(np.int64).reshape(x.shape)

    def __repr__(self) -> str:
        return f"Feistel(n={self.n}, rounds={len(self._keys)})"
