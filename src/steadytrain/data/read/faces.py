"""What a trainer sees of a ``TokenLoader``: the batch's labels, and ``Dataset`` faces.

``TokenLoader`` is an iterator with ``state_dict``/``load_state_dict``. Trainers built around
``torch.utils.data.DataLoader`` (Lightning, torchdata's ``StatefulDataLoader``) want an
``IterableDataset`` instead; ``TokenIterableDataset`` is that face, a thin adapter rather
than a base class, so the loader keeps one iteration protocol and one state. The loader's
state goes through ``StatefulDataLoader.state_dict()`` (torchdata's ``Stateful`` protocol:
the dataset has ``state_dict``/``load_state_dict``), so exact resume survives it.

A trainer that batches, shards and resumes items with a sampler of its own (Hugging Face
``Trainer``: it would batch the loader's micro-batches again) takes ``TokenWindows``, the
loader's sample space as a map-style ``Dataset``: item ``i`` is sample ``i``.

The labels convention lives here too, because getting it wrong trains silently on the wrong
target: ``"next"`` labels are the inputs shifted by one (the model predicts ``labels[t]``
from ``input_ids[:t+1]``), ``"same"`` labels equal the inputs (Hugging Face causal-LM
models shift inside their loss; given ``"next"`` labels they would learn token t+2).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from steadytrain.data.read.loader_state import make_state
from steadytrain.data.read.sampler import Refs, Sampler
from steadytrain.errors import ConfigError

if TYPE_CHECKING:
    from steadytrain.data.read.loader import TokenLoader
    from steadytrain.data.read.workers import Reader

__all__ = [
    "LABELS",
    "TokenIterableDataset",
    "TokenWindows",
    "doc_info",
    "labels_from_windows",
    "make_batch",
]

# Micro-batches handed out and not yet reported consumed that a dataset keeps track of.
_AHEAD = 1024

# The labels conventions: name -> what ``labels`` holds.
LABELS = {
    "same": "labels equal input_ids (Hugging Face causal-LM models shift inside their loss)",
    "next": "labels are input_ids shifted by one (the next token; the model does not shift)",
}


def labels_from_windows(pair: np.ndarray, windows: np.ndarray | None, labels: str) -> None:
    """Fill ``pair[1]`` (labels) for the convention ``labels``. ``pair[0]`` already holds the
    inputs; ``windows`` are the ``[micro, seq_len + 1]`` token windows (None when ``pair[1]``
    already holds the labels in that convention, as ``Reader.fill_pair`` writes them)."""
    if windows is None:
        return
    if labels == "same":
        # A copy, never a view: a trainer that masks labels in place (pad -> -100) must not
        # change its inputs.
        np.copyto(pair[1], pair[0])
    else:
        pair[1] = windows[:, 1:]


def make_batch(
    loader: TokenLoader, q: int, pair: np.ndarray, windows: np.ndarray | None, reader: Reader
) -> dict[str, torch.Tensor]:
    """Micro-batch ``q`` as the trainer gets it, from ``pair`` (``[2, micro, seq_len]``:
    inputs, and labels shifted by one unless ``windows`` is given): labels in the loader's
    convention, the optional document info, pinned if asked. ``pair`` is wrapped, not copied."""
    labels_from_windows(pair, windows, loader.labels)
    batch = {
        "input_ids": torch.from_numpy(pair[0]),
        "labels": torch.from_numpy(pair[1]),
        # a view of the chunk's ids, never written again
        "sample_ids": torch.from_numpy(reader.sample_ids(q)),
    }
    if loader.return_doc_ids or loader.return_position_ids:
        doc_ids, pos_ids = doc_info(loader.datasets, reader.refs(q), loader.seq_len)
        if loader.return_doc_ids:
            batch["doc_ids"] = torch.from_numpy(doc_ids)
        if loader.return_position_ids:
            batch["position_ids"] = torch.from_numpy(pos_ids)
    if loader.pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def doc_info(datasets: list[Any], refs: Refs, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token: which document of the sample it belongs to, and its position in it."""
    rows = refs.offset.size
    doc_ids = np.empty((rows, seq_len), dtype=np.int64)
    pos_ids = np.empty((rows, seq_len), dtype=np.int64)
    span = np.arange(seq_len, dtype=np.int64)
    for row, (d, s, o) in enumerate(
        zip(refs.dataset.tolist(), refs.shard.tolist(), refs.offset.tolist(), strict=True)
    ):
        ends = datasets[d].doc_ends(s)
        p = o + span
        idx = np.searchsorted(ends, p.astype(np.uint64), side="right").astype(np.int64)
        starts = np.where(idx > 0, np.asarray(ends[np.maximum(idx - 1, 0)], np.int64), 0)
        doc_ids[row] = idx - idx[0]
        pos_ids[row] = p - starts
    return doc_ids, pos_ids


class TokenIterableDataset(IterableDataset):
    """``TokenLoader`` as an ``IterableDataset``: each item is one micro-batch (a dict of
    tensors), so use it with ``DataLoader(ds, batch_size=None, num_workers=0)`` or torchdata's
    ``StatefulDataLoader`` (same arguments).

    ``num_workers`` must stay 0 in the DataLoader: the loader already reads in the background
    (its own thread or worker processes, ``TokenLoader(num_workers=...)``), and each DataLoader
    worker would hold a full copy of the stream and hand out every micro-batch again. That is
    refused with an error. The stream is infinite (steps, not epochs): iterating again
    continues where the last iteration stopped.

    ``state_dict``/``load_state_dict`` are the loader's (torchdata's ``Stateful`` protocol),
    so ``StatefulDataLoader.state_dict()`` carries the exact position. DataLoader's own
    ``pin_memory`` also works; prefer ``TokenLoader(pin_memory=True)``, which pins off the
    training thread.

    A trainer that fetches ahead of the batch it trains (Lightning fetches one) holds a
    position past what the model consumed. For it, the dataset notes the loader's position
    after each micro-batch it hands out; the trainer reports each micro-batch it trained on
    with ``consumed()`` (in order: the oldest noted one), and ``consumed_state_dict()`` is
    the state as of the last one reported, whatever the fetch-ahead depth
    (``integrations/lightning_exact.py``).
    """

    def __init__(self, loader: TokenLoader) -> None:
        super().__init__()
        self.loader = loader
        # The loader's cursor after each micro-batch handed out and not yet reported
        # consumed (bounded: a trainer that never reports holds no more than this).
        self._ahead: collections.deque[int] = collections.deque(maxlen=_AHEAD)
        self._consumed: int | None = None  # cursor after the last one reported

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # A generator, not the loader itself: StatefulDataLoader saves the dataset's state
        # only when the iterator it holds is a different object from the dataset.
        if get_worker_info() is not None:
            raise ConfigError(
                "TokenIterableDataset is iterated inside a DataLoader worker process: every "
                "worker would hand out the same micro-batches (duplicated samples). Use "
                "DataLoader(..., num_workers=0) and set TokenLoader(num_workers=N) for "
                "background reading instead"
            )
        return self._stream()

    def _stream(self) -> Iterator[dict[str, torch.Tensor]]:
        loader, ahead = self.loader, self._ahead
        while True:
            batch = next(loader)
            ahead.append(loader._cursor)
            yield batch

    def consumed(self) -> bool:
        """The trainer trained on the oldest micro-batch handed out and not yet reported.
        False when none is outstanding: the trainer's batches do not come from here."""
        if not self._ahead:
            return False
        self._consumed = self._ahead.popleft()
        return True

    def consumed_state_dict(self) -> dict[str, Any]:
        """The loader's state as of the last micro-batch reported ``consumed()`` (none yet:
        as of before the first one handed out): a resume from it starts with the first
        micro-batch fetched but not trained on."""
        cursor = self._consumed
        if cursor is None:
            cursor = self._ahead[0] - 1 if self._ahead else self.loader._cursor
        return make_state(self.loader, cursor)

    def state_dict(self) -> dict[str, Any]:
        """The loader's JSON-serialisable state (position after the last item handed out)."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the loader exactly at the saved position (nothing is outstanding then)."""
        self.loader.load_state_dict(state_dict)
        self._ahead.clear()
        self._consumed = None

    def __repr__(self) -> str:
        return f"TokenIterableDataset({self.loader!r})"


class TokenWindows(Dataset):
    """A ``TokenDataset`` as a map-style ``Dataset``: item ``i`` is sample ``i`` of the
    loader's sample space (``seq_len`` tokens of one shard, docs/loader.md "Sample space"),
    ``{"input_ids", "labels"}`` in the ``labels`` convention (default ``"same"``: Hugging
    Face causal-LM models shift inside their loss).

    For trainers that batch, shuffle, shard across ranks and resume with a sampler of their
    own (Hugging Face ``Trainer``); the order and its resume are then theirs. Memory is
    O(#shards): an item is read from its shard's memory map when asked for.
    """

    def __init__(self, dataset: Any, seq_len: int, labels: str = "same") -> None:
        if labels not in LABELS:
            raise ConfigError(f"labels={labels!r} is not one of {sorted(LABELS)}")
        self.dataset, self.seq_len, self.labels = dataset, int(seq_len), labels
        # The sequential order: position i is sample id i (the id -> shard lookup, once).
        self._sampler = Sampler([dataset], self.seq_len, 1, mode="sequential")

    def __len__(self) -> int:
        return self._sampler.num_samples[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is outside this dataset's {len(self)} samples")
        refs = self._sampler.locate(np.array([i], dtype=np.int64))
        start = int(refs.offset[0])
        tokens = self.dataset.tokens(int(refs.shard[0]))[start : start + self.seq_len + 1]
        window = np.asarray(tokens, dtype=np.int64)[None]
        pair = np.empty((2, 1, self.seq_len), dtype=np.int64)
        pair[0] = window[:, :-1]
        labels_from_windows(pair, window, self.labels)
        return {"input_ids": torch.from_numpy(pair[0, 0]), "labels": torch.from_numpy(pair[1, 0])}
