"""What a trainer sees of a ``TokenLoader``: the batch's labels, and a ``Dataset`` face.

``TokenLoader`` is an iterator with ``state_dict``/``load_state_dict``. Trainers built around
``torch.utils.data.DataLoader`` (HF Trainer, Lightning, torchdata's ``StatefulDataLoader``)
want an ``IterableDataset`` instead; ``TokenIterableDataset`` is that face, a thin adapter
rather than a base class, so the loader keeps one iteration protocol and one state. The
loader's state goes through ``StatefulDataLoader.state_dict()`` (torchdata's ``Stateful``
protocol: the dataset has ``state_dict``/``load_state_dict``), so exact resume survives it.

The labels convention lives here too, because getting it wrong trains silently on the wrong
target: ``"next"`` labels are the inputs shifted by one (the model predicts ``labels[t]``
from ``input_ids[:t+1]``), ``"same"`` labels equal the inputs (Hugging Face causal-LM
models shift inside their loss; given ``"next"`` labels they would learn token t+2).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from steadytrain.data.read.sampler import Refs
from steadytrain.errors import ConfigError

if TYPE_CHECKING:
    from steadytrain.data.read.loader import TokenLoader
    from steadytrain.data.read.workers import Reader

__all__ = ["LABELS", "TokenIterableDataset", "doc_info", "labels_from_windows", "make_batch"]

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
    """

    def __init__(self, loader: TokenLoader) -> None:
        super().__init__()
        self.loader = loader

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
        loader = self.loader
        while True:
            yield next(loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's JSON-serialisable state (position after the last item handed out)."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the loader exactly at the saved position."""
        self.loader.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"TokenIterableDataset({self.loader!r})"
