"""``block``: permute blocks of consecutive samples, then shuffle inside a bounded window.

The epoch's positions are cut into windows of ``window_blocks * block_size`` positions.
Window ``w`` reads the ``window_blocks`` blocks in slots ``[w W, (w + 1) W)`` of a keyed
permutation of all blocks, in an order shuffled inside the window. So at any time the reader
needs only the current window's blocks (plus the next window's, to prefetch): a cache of
``2 * window_blocks`` blocks serves the whole run, while batches still mix ``W`` distant
parts of the dataset. The last block may be short: the map is a permutation of the padded
space ``[0, blocks * B)`` made a bijection of ``[0, n)`` by cycle-walking.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from steadytrain.data.read.permute import Feistel, derive_key
from steadytrain.errors import ConfigError

DEFAULT_BLOCK_SIZE = 256  # samples: 2 MiB of uint16 tokens at seq 4096
DEFAULT_WINDOW_BLOCKS = 64


class BlockOrder:
    name = "block"

    def __init__(
        self,
        n: int,
        key: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        window_blocks: int = DEFAULT_WINDOW_BLOCKS,
    ) -> None:
        if int(block_size) < 1 or int(window_blocks) < 1:
            raise ConfigError(
                f"shuffle='block' needs block_size >= 1 and window_blocks >= 1, got "
                f"block_size={block_size}, window_blocks={window_blocks}"
            )
        self.n, self.key = n, key
        self.block_size, self.window_blocks = int(block_size), int(window_blocks)
        self.num_blocks = -(-n // self.block_size)
        self.window = self.block_size * self.window_blocks  # positions per window
        self._epoch: int | None = None
        self._windows: dict[int, Feistel] = {}

    def _block_perm(self, epoch: int) -> Feistel:
        if self._epoch != epoch:
            self._epoch, self._windows = epoch, {}
            self._blocks = Feistel(self.num_blocks, derive_key(self.key, epoch, 0))
        return self._blocks

    def _window_perm(self, epoch: int, w: int) -> Feistel:
        self._block_perm(epoch)
        perm = self._windows.get(w)
        if perm is None:
            padded = self.num_blocks * self.block_size
            size = min(self.window, padded - w * self.window)
            if len(self._windows) > 64:
                self._windows.clear()
            perm = self._windows[w] = Feistel(size, derive_key(self.key, epoch, 1, w))
        return perm

    def _padded(self, i: np.ndarray, epoch: int) -> np.ndarray:
        w, u = np.divmod(i, self.window)
        out = np.empty_like(i)
        for win in np.unique(w):
            sel = w == win
            v = self._window_perm(epoch, int(win))(u[sel])
            slot, offset = np.divmod(v, self.block_size)
            block = self._block_perm(epoch)(slot + int(win) * self.window_blocks)
            out[sel] = block * self.block_size + offset
        return out

    def ids(self, i: np.ndarray, epoch: int) -> np.ndarray:
        i = np.asarray(i, dtype=np.int64)
        out = self._padded(i.ravel(), epoch)
        outside = np.flatnonzero(out >= self.n)
        while outside.size:  # the short last block's missing ids: walk on
            walked = self._padded(out[outside], epoch)
            out[outside] = walked
            outside = outside[walked >= self.n]
        return out.reshape(i.shape)

    def spans(self, i_lo: int, i_hi: int, epoch: int) -> Iterator[tuple[np.ndarray, ...]]:
        # A window's blocks are all reported at the window's first position in the range:
        # the window is the unit a cache must hold.
        perm = self._block_perm(epoch)
        short = self.n % self.block_size != 0
        last_window = (self.num_blocks - 1) // self.window_blocks
        for w in range(i_lo // self.window, (i_hi - 1) // self.window + 1):
            first = max(i_lo, w * self.window)
            slots = np.arange(w * self.window_blocks, (w + 1) * self.window_blocks)
            slots = slots[slots < self.num_blocks]
            blocks = perm(slots)
            if short and (blocks == self.num_blocks - 1).any():
                # The short block's missing ids cycle-walk to padded positions >= n, which
                # all lie in the last window: its blocks may be read here too.
                extra = np.arange(last_window * self.window_blocks, self.num_blocks)
                blocks = np.unique(np.concatenate([blocks, perm(extra)]))
            lo = blocks * self.block_size
            hi = np.minimum(lo + self.block_size, self.n)
            yield np.full(lo.shape, first), lo, hi

    def settings(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "window_blocks": self.window_blocks}
