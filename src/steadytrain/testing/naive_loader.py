"""A deliberately naive loader: the growing shared-memory index of the incident we remember.

In the 384-GPU run (DESIGN.md) the data loader built a sample index that grew with the
number of steps, kept in shared memory so its worker processes could see it, until
/dev/shm ran out. ``NaiveIndexLoader`` replays that on purpose, for the ``loader-memory``
incident replay (``steadytrain.testing.incidents.loader_memory``) and nothing else:

* every step it *materialises* that step's sample index (the step's sample ids, padded to
  ``bytes_per_step``: such loaders store per-sample offsets, document ids and shuffle
  indices at full width) and appends it to one file under /dev/shm that is never freed
  while the process lives;
* serving a step maps the whole index and scans it from the start (the lookup such a loader
  does to find the step's entries), so the time inside ``next()`` grows with the step count
  and every page of the index stays resident in this process;
* it reads synchronously inside ``next()`` (no prefetch thread, as simple loaders do), so
  its read times are those of the reads, not of a thread the scan starves of the GIL.

The batches themselves are exactly ``TokenLoader``'s (it is a subclass): losses, resume and
checkpoints are those of the real loader, only memory and data wait differ. Growth stops at
``max_bytes`` (a replay must not fill a shared machine's /dev/shm), and leaving the loader's
``with`` block (``release()``) deletes the file; a process killed before that leaves it, so a replay deletes
``/dev/shm/{PREFIX}*`` of its own tag at the end.

Running the real training loop with it on some nodes only (the others keep TokenLoader)::

    STEADYTRAIN_NAIVE_LOADER_NODES=node-1 torchrun ... \\
        -m steadytrain.testing.naive_loader train demo --set ...

takes the same arguments as ``steadytrain train`` and calls ``run_training`` with
``make_loader=NaiveIndexLoader`` where ``$STEADYTRAIN_NODE`` is listed.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from steadytrain.data.read.loader import TokenLoader

__all__ = ["NODES_ENV", "PREFIX", "NaiveIndexLoader", "index_tag", "main"]

NODES_ENV = "STEADYTRAIN_NAIVE_LOADER_NODES"  # comma-separated node names
PREFIX = "steadytrain-naive-index-"
MiB = 1 << 20


class NaiveIndexLoader(TokenLoader):
    """``TokenLoader`` plus a per-step index in /dev/shm that grows by ``bytes_per_step``
    every step (up to ``max_bytes``) and is scanned whole on every step."""

    def __init__(
        self,
        *args: Any,
        shm_dir: str = "/dev/shm",
        tag: str = "",
        bytes_per_step: int = 8 * MiB,
        max_bytes: int = 256 * MiB,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.prefetch = 0  # synchronous reads (see the module docstring)
        if bytes_per_step < 8 or max_bytes < bytes_per_step:
            raise ValueError(
                f"NaiveIndexLoader: bytes_per_step={bytes_per_step}, max_bytes={max_bytes}: "
                "use at least 8 bytes per step and max_bytes >= bytes_per_step"
            )
        if not os.path.isdir(shm_dir):
            raise FileNotFoundError(
                f"NaiveIndexLoader: {shm_dir} does not exist; pass shm_dir= a tmpfs directory"
            )
        self.bytes_per_step, self.max_bytes = bytes_per_step, max_bytes
        name = f"{PREFIX}{tag}-rank{self.rank}-{os.getpid()}"
        self.path = os.path.join(shm_dir, name)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._size = 0
        self._map: mmap.mmap | None = None
        self.index_checksum = 0

    @property
    def index_bytes(self) -> int:
        return self._size

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = super().__next__()
        if (self._cursor - 1) % self.micro_per_step == 0:  # the first micro-batch of a step
            self._index_step(batch["sample_ids"].numpy())
        return batch

    def _index_step(self, sample_ids: np.ndarray) -> None:
        """Append this step's index entry, then map and scan the whole index."""
        if self._fd is None:
            return
        if self._size + self.bytes_per_step <= self.max_bytes:
            entry = np.resize(sample_ids.astype(np.int64), self.bytes_per_step // 8)
            entry ^= np.arange(entry.size, dtype=np.int64)  # distinct pages, all written
            os.pwrite(self._fd, entry.tobytes(), self._size)
            self._size += entry.nbytes
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self._fd, self._size)  # shared: counts in RSS once touched
        if self._map is not None:
            whole = np.frombuffer(self._map, dtype=np.int64)
            self.index_checksum = int(np.bitwise_xor.reduce(whole))
            del whole  # a live view would keep the map from closing

    def release(self) -> None:
        """Unmap and delete the index (``close()`` only stops reading, as TokenLoader's
        does: a resume calls it, and a growing index outlives a resume)."""
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.release()

    def __del__(self) -> None:
        super().__del__()
        try:
            self.release()
        except Exception:  # interpreter shutdown: the replay deletes what is left
            pass


def index_tag(run_dir: str) -> str:
    """A short tag of the run directory: this run's index files, not another run's."""
    return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:10]


def main(argv: Sequence[str] | None = None) -> int:
    """``steadytrain train``'s arguments (``train CONFIG --set ...``); the naive loader on
    the nodes named in ``$STEADYTRAIN_NAIVE_LOADER_NODES``, TokenLoader elsewhere."""
    from steadytrain.commands import train as train_command
    from steadytrain.train.config import load_config, resolve_config_path
    from steadytrain.train.loop import run_training

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:
        args = args[1:]
    p = argparse.ArgumentParser(prog="python -m steadytrain.testing.naive_loader train")
    train_command.add_arguments(p)
    ns = p.parse_args(args)
    cfg = load_config(resolve_config_path(ns.config), ns.overrides)
    nodes = {n.strip() for n in os.environ.get(NODES_ENV, "").split(",") if n.strip()}
    node = os.environ.get("STEADYTRAIN_NODE", "")
    if node and node in nodes:
        print(f"[naive-loader] {node}: NaiveIndexLoader (index in /dev/shm)", file=sys.stderr)
        run_training(
            cfg, make_loader=functools.partial(NaiveIndexLoader, tag=index_tag(cfg.run_dir))
        )
    else:
        run_training(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
