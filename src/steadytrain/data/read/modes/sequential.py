"""``sequential``: position i reads sample i (for data shuffled offline by ``shuffle``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from steadytrain.errors import ConfigError


class SequentialOrder:
    name = "sequential"

    def __init__(self, n: int, key: int, **settings: Any) -> None:
        if settings:
            raise ConfigError(f"shuffle='sequential' takes no settings, got {sorted(settings)}")
        self.n = n

    def ids(self, i: np.ndarray, epoch: int) -> np.ndarray:
        return np.asarray(i, dtype=np.int64)

    def spans(self, i_lo: int, i_hi: int, epoch: int) -> Iterator[tuple[np.ndarray, ...]]:
        yield np.array([i_lo]), np.array([i_lo]), np.array([i_hi])

    def settings(self) -> dict[str, Any]:
        return {}
