"""Micro-batches as the trainer gets them, filled into reused int64 blocks.

A ``TokenLoader`` reads a group of micro-batches at a time (its background thread: the group
it hands over at once, ``producers.ThreadProducer``; in-process: one): one gather of the
group's windows and one widening cast each for inputs and labels into one block of a
``BufferRing``, the micro-batches being views of it. Per micro-batch only the tensors and
the dict are made, so the per-call overhead of Python and numpy is paid once a group rather
than once a micro-batch. A block is refilled only once nothing outside the ring refers to
it: a trainer that keeps one micro-batch of a group keeps the whole block from reuse, never
from being its own.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from steadytrain.data.read.faces import make_batch
from steadytrain.data.read.producers import ThreadProducer
from steadytrain.data.read.workers import BufferRing, Reader

if TYPE_CHECKING:
    from steadytrain.data.read.loader import TokenLoader

Batch = dict[str, torch.Tensor]


def alloc_block(shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Two int64 blocks ``[group, micro, seq_len]`` (inputs, labels) for a ``BufferRing``.
    Never page-locked: a ``non_blocking`` copy to the GPU from pinned memory returns before
    the copy is done, and the trainer drops its CPU tensors at once, so a reused pinned
    buffer could be refilled under a transfer still in flight. ``pin_memory=True`` copies
    each micro-batch into torch's caching host allocator instead (``make_batch``), which
    waits for the copy's CUDA event before it hands a block out again."""
    return np.empty(shape, dtype=np.int64), np.empty(shape, dtype=np.int64)


def take_block(loader: TokenLoader, reader: Reader, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of ``group`` micro-batches' inputs and labels from the reader's ring (made
    on first use, with the block size of that first call). Sized for what can be alive at
    once: the micro-batches waiting ready, the group being filled, the trainer's current
    and previous micro-batches (two blocks at most) and a short group at a chunk's end;
    past that, fresh blocks."""
    ring = reader.out_ring
    if ring is None:
        ready = ThreadProducer.capacity(loader.prefetch) if loader.prefetch else 0
        # not a bound method: the reading thread holds the ring, never the loader
        alloc = functools.partial(alloc_block, (group, loader.micro_batch, loader.seq_len))
        ring = reader.out_ring = BufferRing(alloc, -(-ready // group) + 4)
    return ring.take()


def read_group(
    loader: TokenLoader, q: int, n: int, reader: Reader, *, ahead: bool = False
) -> list[tuple[Batch, int]]:
    """Micro-batches ``q, q+1, ...`` read from the maps, up to ``n`` (fewer at the end of a
    chunk of mapped positions), each with the bytes it read.

    ``ahead`` (the background thread): the next group's windows are gathered before this
    one is returned (``Reader.stage``), so the caller hands this group over just before
    the next call's casts, which release the GIL, so the training thread it wakes waits
    less for the GIL (every hand-over of the GIL between the threads is a sleep and a
    wake-up, each a few microseconds of CPU; on a loaded machine the woken thread still
    slept on the GIL twice a group besides its wake-up: 0.74 voluntary context switches a
    micro-batch, BENCHMARKS.md "Third pass"). The look-ahead opens no new shard and raises
    nothing: a group never waits on a fetch for the next one."""
    inputs, labels = take_block(loader, reader, n)
    n = min(n, inputs.shape[0], reader.group_end(q, n) - q)
    reader.fill_pair(q, inputs, labels, shift=loader.labels == "next", n=n)
    fixed = reader._fixed_nbytes
    sizes = [fixed] * n if fixed is not None else [reader.nbytes(q + i) for i in range(n)]
    if loader.return_doc_ids or loader.return_position_ids or loader.pin_memory:
        made = [
            (make_batch(loader, q + i, (inputs[i], labels[i]), None, reader), sizes[i])
            for i in range(n)
        ]
    else:
        ids = reader.sample_ids_group(q, n)  # views of the chunk's ids, never written again
        wrap = torch.from_numpy
        made = [
            (
                {
                    "input_ids": wrap(inputs[i]),
                    "labels": wrap(labels[i]),
                    "sample_ids": wrap(ids[i]),
                },
                sizes[i],
            )
            for i in range(n)
        ]
    if ahead:
        nxt = q + n
        reader.stage(nxt, reader.group_end(nxt, inputs.shape[0]) - nxt, ahead=True)
    return made


def finish(loader: TokenLoader, q: int, raw: np.ndarray, reader: Reader) -> Batch:
    """Micro-batch ``q`` from a worker's raw ``[micro, seq_len + 1]`` windows."""
    blocks = take_block(loader, reader, 1)
    inputs, labels = blocks[0][0], blocks[1][0]
    np.copyto(inputs, raw[:, :-1])
    np.copyto(labels, raw[:, 1:] if loader.labels == "next" else raw[:, :-1])
    pair: Any = (inputs, labels)
    return make_batch(loader, q, pair, None, reader)
