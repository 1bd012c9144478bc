"""The loader's reused output buffers and its thread hand-off.

Batches are filled into a ring of reused arrays (``BufferRing``): a batch, or any tensor or
view of it, that the trainer still holds must never be overwritten, while batches it drops
must be reused (the point of the ring). The thread hand-off (``_Handoff``) must keep order,
respect its capacity and deliver an error without waiting for a full group.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from steadytrain.data.read.loader import TokenLoader
from steadytrain.data.read.producers import _Handoff
from steadytrain.data.read.workers import BufferRing

SEQ = 16


def loader(ds, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, global_batch=8, micro_batch=2, seed=1)
    args.update(kw)
    return TokenLoader(ds, **args)


def _counting_ring(size: int) -> tuple[BufferRing, list[int]]:
    made: list[int] = []

    def alloc():
        made.append(1)
        return np.zeros(4, np.int64), np.zeros(4, np.int64)

    return BufferRing(alloc, size), made


def test_ring_reuses_released_slots_and_never_hands_out_a_held_one():
    ring, made = _counting_ring(3)
    for _ in range(20):  # each slot dropped at once: one buffer serves them all
        ring.take()
    assert len(made) == 1
    a = ring.take()
    first = id(a[0])  # the ring keeps the slot: its id stays its own
    held_tensor = torch.from_numpy(a[0])[1:]  # only a view of a tensor of it is kept
    del a
    for _ in range(10):
        assert id(ring.take()[0]) != first
    a = next(s for s in ring._slots if id(s[0]) == first)
    held_labels = a[1][2:]  # now only a numpy view of the slot's other array
    del a, held_tensor
    for _ in range(10):
        assert id(ring.take()[0]) != first
    del held_labels
    assert any(id(ring.take()[0]) == first for _ in range(3)), "slot not reused once free"


def test_ring_keeps_its_size_when_every_slot_is_held():
    ring, made = _counting_ring(2)
    # a caller that keeps everything it was given (tensors of both arrays)
    kept = [tuple(torch.from_numpy(a) for a in ring.take()) for _ in range(6)]
    assert len({k[0].data_ptr() for k in kept}) == 6  # all distinct: none overwritten
    assert len(ring) == 2 and len(made) == 6
    del kept
    before = len(made)
    for _ in range(10):
        ring.take()
    assert len(made) == before  # back to reuse once released


@pytest.mark.parametrize("prefetch", [0, 4])
def test_kept_batches_are_never_overwritten(ds_a, prefetch):
    """A trainer that keeps every batch (or only views of them) sees exactly what a fresh
    loader hands out one by one: a reused buffer under a held batch would differ."""
    with loader(ds_a, labels="next", prefetch=prefetch) as ld:
        kept = [next(ld) for _ in range(30)]
        views = [(b["input_ids"][0], b["labels"][:, 1:]) for b in kept[:10]]
        for _ in range(30):
            next(ld)  # more reads after the kept ones: they must not land in kept buffers
    with loader(ds_a, labels="next", prefetch=0) as ref:
        for i, b in enumerate(kept):
            want = next(ref)
            for key in ("input_ids", "labels", "sample_ids"):
                assert torch.equal(b[key], want[key]), (i, key)
            if i < 10:
                assert torch.equal(views[i][0], want["input_ids"][0])
                assert torch.equal(views[i][1], want["labels"][:, 1:])


@pytest.mark.parametrize("prefetch", [0, 4])
def test_dropped_batches_reuse_a_few_buffers(ds_a, prefetch):
    with loader(ds_a, prefetch=prefetch) as ld:
        for _ in range(60):
            b = next(ld)
            b["labels"][:] = -100  # a trainer that masks labels in place: no harm done
        reader = ld._refs if prefetch == 0 else ld._producer._reader
        ring = reader.out_ring
        assert ring is not None and len(ring) <= ring._size < 60
        b = next(ld)
        assert (b["labels"] != -100).all()  # each batch is filled anew, labels included


def test_handoff_keeps_order_and_capacity_with_a_slow_consumer():
    h = _Handoff(capacity=4, group=2)
    peak = []

    def produce():
        for i in range(40):
            if not h.put(i):
                return
            peak.append(len(h.items))

    t = threading.Thread(target=produce)
    t.start()
    got = []
    while len(got) < 40:
        item = h.get(1.0)
        assert item is not None, "a consumer waiting on a group was never woken"
        got.append(item)
        if len(got) % 7 == 0:
            time.sleep(0.01)  # the producer fills up and must wait
    t.join(5)
    assert got == list(range(40))
    assert max(peak) <= 4


def test_handoff_delivers_an_error_without_a_full_group():
    h = _Handoff(capacity=16, group=8)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(h.get(5.0)))
    waiter.start()
    time.sleep(0.05)  # the consumer is asleep, waiting for a group of 8
    t0 = time.monotonic()
    h.put(RuntimeError("boom"), now=True)
    waiter.join(5)
    assert isinstance(got[0], RuntimeError)
    assert time.monotonic() - t0 < 4.0  # woken, not timed out (5 s)


def test_handoff_close_releases_a_producer_waiting_on_a_full_deque():
    h = _Handoff(capacity=2, group=1)
    result: list = []

    def produce():
        for i in range(10):
            if not h.put(i):
                result.append("stopped")
                return

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(0.05)
    assert t.is_alive()  # blocked: nobody consumes
    h.close()
    t.join(5)
    assert not t.is_alive() and result == ["stopped"]
