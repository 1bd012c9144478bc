"""``global``: a full keyed permutation of the epoch's samples (Feistel, re-keyed per epoch)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from steadytrain.data.read.permute import Feistel, derive_key
from steadytrain.errors import ConfigError

SPAN_CHUNK = 1 << 16  # positions evaluated per look-ahead chunk


class GlobalOrder:
    name = "global"

    def __init__(self, n: int, key: int, **settings: Any) -> None:
        if settings:
            raise ConfigError(f"shuffle='global' takes no settings, got {sorted(settings)}")
        self.n, self.key = n, key
        self._perm: tuple[int, Feistel] | None = None

    def _feistel(self, epoch: int) -> Feistel:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, Feistel(self.n, derive_key(self.key, epoch)))
        return self._perm[1]

    def ids(self, i: np.ndarray, epoch: int) -> np.ndarray:
        return self._feistel(epoch)(i)

    def spans(self, i_lo: int, i_hi: int, epoch: int) -> Iterator[tuple[np.ndarray, ...]]:
        # Every position may land anywhere: evaluate exactly, a chunk at a time, so a caller
        # that has already seen every shard can stop early.
        for lo in range(i_lo, i_hi, SPAN_CHUNK):
            pos = np.arange(lo, min(i_hi, lo + SPAN_CHUNK), dtype=np.int64)
            ids = self.ids(pos, epoch)
            yield pos, ids, ids + 1

    def settings(self) -> dict[str, Any]:
        return {}
