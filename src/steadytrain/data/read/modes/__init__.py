"""Sample orders within one dataset's epoch, one module per strategy, chosen by name.

An order maps in-epoch positions ``i`` in ``[0, n)`` to sample ids (a bijection of
``[0, n)``), re-keyed for every epoch, and describes which sample-id ranges a position range
touches (``spans``) so the cache can look ahead without evaluating every position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from steadytrain.data.read.modes.block import BlockOrder
from steadytrain.data.read.modes.global_ import GlobalOrder
from steadytrain.data.read.modes.sequential import SequentialOrder
from steadytrain.errors import ConfigError

__all__ = ["MODES", "Order", "make_order"]

# Arrays (first position, first id, end id): positions >= first position read ids [lo, hi).
Spans = tuple[np.ndarray, np.ndarray, np.ndarray]


class Order(Protocol):
    name: str

    def ids(self, i: np.ndarray, epoch: int) -> np.ndarray: ...

    def spans(self, i_lo: int, i_hi: int, epoch: int) -> Iterator[Spans]: ...

    def settings(self) -> dict[str, Any]: ...


MODES: dict[str, type] = {
    "global": GlobalOrder,
    "block": BlockOrder,
    "sequential": SequentialOrder,
}


def make_order(mode: str, n: int, key: int, settings: dict[str, Any]) -> Order:
    cls = MODES.get(mode)
    if cls is None:
        raise ConfigError(f"shuffle={mode!r} is not one of {sorted(MODES)}")
    return cls(n, key, **settings)
