"""Reading micro-batches: shared by the loader's thread and its worker processes.

This module never imports torch, so a spawned worker starts in a fraction of a second.
A worker holds only memory maps (its own, re-opened from the pickled datasets) and
integers; it sends each micro-batch as one message of raw token bytes on a plain pipe,
in the dataset's dtype (2 bytes a token for uint16: a quarter of the int64 the trainer gets),
with a fixed header. No named shared-memory segment exists at any time.
"""

from __future__ import annotations

import pickle
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from steadytrain.data.read.sampler import BatchPlan, Refs, Sampler
from steadytrain.errors import DatasetError

# q (micro-batch index), read seconds, bytes read, flag (0 data, 1 pickled exception),
# node-cache hits and misses in this worker since its previous message (the worker's own
# ShardCache counts them, out of the loader's sight otherwise)
HEADER = struct.Struct("<qdqBII")
# ndarray.max() without its Python wrapper (numpy/_core/_methods.py): ~1 us a micro-batch
_MAX = np.maximum.reduce
CHUNK = 256  # micro-batches whose positions are mapped together (amortises numpy overhead)


class _Chunk(NamedTuple):
    """Micro-batches ``[lo, lo + CHUNK)`` mapped at once. Rows are kept as plain Python
    lists (per-row numpy scalars cost more than a window's copy): each row's shard slot
    (its index among all datasets' shards) and token offset."""

    lo: int
    refs: Refs
    slots: list[int]
    offsets: list[int]  # in bytes on the byte path (``Reader.fill``), else in tokens
    nbytes: list[int] | None  # per micro-batch, when datasets of several dtypes blend


class BufferRing:
    """Reused output buffers for micro-batches: ``take()`` hands out a slot again only once
    nothing outside the ring refers to its arrays any more.

    The contract for the trainer is unchanged: a batch it keeps (or a view or tensor of it)
    is never overwritten. Tensors made with ``torch.from_numpy`` hold a reference to the
    array, numpy views hold their base, so an array's reference count is back at the ring's
    own once every batch, tensor and view made of it is gone; only then is the slot refilled.
    A slot still held is skipped, and when every slot is held (a caller that keeps its
    batches) a fresh buffer replaces one in the ring (in turn), which the caller keeps.
    Reuse saves the allocation (and, where malloc returns the memory, the page faults) of a
    fresh ~256 KiB buffer a micro-batch: the int64 floor into a reused buffer ran 1.06x to
    1.6x the one into fresh arrays per CPU-second, by run (bench/loader_throughput.py). Only what the ring can see is guarded: a
    buffer must not be handed to anything that reads it after its last Python reference is
    gone (an asynchronous copy from page-locked memory), so the loader never pins a ring.

    One thread takes from a ring (each producer's ``Reader`` has its own).
    """

    def __init__(self, alloc: Callable[[], tuple[np.ndarray, np.ndarray]], size: int) -> None:
        self._alloc = alloc
        self._slots: list[tuple[np.ndarray, np.ndarray]] = []
        self._size = max(1, size)
        self._next = 0  # the slot replaced next when every one is held
        self._base = 0  # the reference count of a free slot's array, seen from take()

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """A slot ``(inputs, labels)`` that nothing outside the ring refers to: the first
        free one, so the fewest buffers stay in use and warm in the cache (measured in
        thread mode, alternating rounds: 48.8 vs 50.7 us of CPU a micro-batch against
        taking them in turn)."""
        slots, base, count = self._slots, self._base, sys.getrefcount
        for slot in slots:
            if count(slot[0]) <= base and count(slot[1]) <= base:
                return slot
        slot = self._alloc()
        if not base:
            # Measured, not assumed (Python 3.14 borrows references on the stack): the
            # count of an array held by its slot only, by the same expression as above.
            self._base = count(slot[0])
        if len(slots) < self._size:
            slots.append(slot)
        else:  # every slot held: the caller keeps the one replaced, the ring forgets it
            slots[self._next] = slot
            self._next = (self._next + 1) % len(slots)
        return slot

    def __len__(self) -> int:
        return len(self._slots)


class Reader:
    """Fills ``[micro, seq_len + 1]`` token windows for a rank's micro-batches."""

    def __init__(
        self,
        datasets: Sequence[Any],
        sampler: Sampler,
        plan: BatchPlan,
        *,
        byte_copies: bool = True,
    ) -> None:
        self.datasets, self.sampler, self.plan = datasets, sampler, plan
        self.window = sampler.seq_len + 1
        self.dtype = np.dtype("<u4" if any(d.dtype.itemsize > 2 for d in datasets) else "<u2")
        self._current: int | None = None  # slot of the shard being read now
        self._chunk: _Chunk | None = None
        self._chunk_lo, self._chunk_hi = 0, 0  # micro-batches [lo, hi) of self._chunk
        self._itemsizes = np.array([d.dtype.itemsize for d in datasets], dtype=np.int64)
        # One slot per shard of every dataset (O(#shards)); maps are opened on first use.
        self._slot_base = np.cumsum([0] + [d.num_shards for d in datasets], dtype=np.int64)
        self._views: list[Any] = [None] * int(self._slot_base[-1])
        # The byte path: when every dataset has the staging dtype, windows are copied as
        # raw bytes between memoryviews, which costs less per row than numpy's slicing and
        # assignment (measured: 10.7 vs 15.0 us per 8 x 2048 micro-batch, best of 7). It
        # holds the GIL through each 4 KiB copy, where numpy releases and retakes it per
        # row: the loader's background thread uses it too since the threads hand over
        # once per group of micro-batches (producers._Handoff; measured, interleaved in
        # one process: 3.6 vs 4.2 CPU ns/token for the pair of threads with byte copies).
        # byte_copies=False is kept for a caller that wants the GIL released per row.
        self._bytes = (
            byte_copies and self.dtype.isnative and all(d.dtype == self.dtype for d in datasets)
        )
        self._itemsize = self.dtype.itemsize
        self._row_bytes = self.window * self._itemsize
        # Bytes one micro-batch reads: a constant unless datasets of several dtypes blend.
        self._fixed_nbytes = (
            plan.micro_batch * int(self._itemsizes[0]) * self.window
            if len(set(self._itemsizes.tolist())) == 1
            else None
        )
        # Reused staging windows in the token dtype (``fill_pair``), for groups of up to
        # ``_stage.shape[0] // micro_batch`` micro-batches (grown on demand): the per-sample
        # copies stay small, and the widening to int64 runs as two casts per group. Per
        # group size: (bytes of the windows, the windows, the inputs' and the next-token
        # labels' source views [n, micro, seq_len]), so a group's casts slice nothing.
        self._stage = np.empty((0, self.window), dtype=self.dtype)
        self._stages: dict[int, tuple[memoryview, np.ndarray, np.ndarray, np.ndarray]] = {}
        # The int64 output blocks its user fills (the loader sets it on first use): one
        # ring per reader, so per thread.
        self.out_ring: BufferRing | None = None
        self.staged: tuple[int, int] | None = None  # (q, n) of the group in the stage
        # Token ids are checked against vocab_size per micro-batch: one numpy max over the
        # filled windows (measured: ~1.2 us for 8 x 2049 uint16 ids, against ~8 us for the
        # copies), and the row-by-row search only when it fails. An id past the vocabulary
        # would otherwise surface later as a bare IndexError in the embedding, naming no
        # file. Skipped when no dataset's dtype can hold such an id (uint16, 65536 ids).
        vocabs = [int(getattr(d, "vocab_size", 0) or 0) for d in datasets]
        self._vocabs = np.array(vocabs, dtype=np.int64)
        self._id_limit = min(vocabs) if vocabs else 0
        self._check_ids = all(v > 0 for v in vocabs) and any(
            v < 1 << (8 * d.dtype.itemsize) for v, d in zip(vocabs, datasets, strict=True)
        )

    def _key(self, slot: int) -> tuple[int, int]:
        d = int(np.searchsorted(self._slot_base, slot, side="right")) - 1
        return d, slot - int(self._slot_base[d])

    @property
    def current(self) -> tuple[int, int] | None:
        """``(dataset, shard)`` being read now, or None between micro-batches."""
        slot = self._current
        return None if slot is None else self._key(slot)

    def _open(self, slot: int) -> Any:
        """The shard's map as bytes (byte path) or as a plain ndarray view: slicing a
        ``np.memmap`` subclass costs more than copying a 2k-token window (measured: 46 vs
        29 us per micro-batch)."""
        d, s = self._key(slot)
        view: Any = np.asarray(self.datasets[d].tokens(s))
        if self._bytes:
            view = memoryview(view).cast("B")
        self._views[slot] = view
        return view

    def _chunk_for(self, q: int) -> _Chunk:
        if self._chunk is None or not self._chunk_lo <= q < self._chunk_hi:
            lo = q - q % CHUNK
            refs = self.sampler.locate(self.plan.positions(lo, lo + CHUNK))
            nbytes = None
            if len(self.datasets) == 1:
                slots = refs.shard
            else:
                slots = self._slot_base[refs.dataset] + refs.shard
                if self._fixed_nbytes is None:
                    per_row = self._itemsizes[refs.dataset] * self.window
                    nbytes = per_row.reshape(CHUNK, -1).sum(axis=1).tolist()
            offsets = refs.offset * self._itemsize if self._bytes else refs.offset
            self._chunk = _Chunk(lo, refs, slots.tolist(), offsets.tolist(), nbytes)
            self._chunk_lo, self._chunk_hi = lo, lo + CHUNK
        return self._chunk

    def refs(self, q: int) -> Refs:
        """Where micro-batch ``q``'s samples live (positions mapped CHUNK at a time)."""
        chunk = self._chunk_for(q)
        mb = self.plan.micro_batch
        sl = slice((q - chunk.lo) * mb, (q - chunk.lo + 1) * mb)
        refs = chunk.refs
        return Refs(refs.dataset[sl], refs.shard[sl], refs.offset[sl], refs.sample_id[sl])

    def sample_ids(self, q: int) -> np.ndarray:
        """Global sample ids of micro-batch ``q`` (a view of its chunk's array)."""
        chunk = self._chunk_for(q)
        a = (q - chunk.lo) * self.plan.micro_batch
        return chunk.refs.sample_id[a : a + self.plan.micro_batch]

    def nbytes(self, q: int) -> int:
        """Bytes of token data micro-batch ``q`` reads."""
        if self._fixed_nbytes is not None:
            return self._fixed_nbytes
        chunk = self._chunk_for(q)
        assert chunk.nbytes is not None
        return chunk.nbytes[q - chunk.lo]

    def group_end(self, q: int, n: int) -> int:
        """End of the group of up to ``n`` micro-batches from ``q`` that one ``fill`` reads
        (a group stays inside one chunk of mapped positions)."""
        return min(q + n, q - q % CHUNK + CHUNK)

    def _stage_for(self, n: int) -> tuple[memoryview, np.ndarray, np.ndarray, np.ndarray]:
        got = self._stages.get(n)
        if got is None:
            mb, w = self.plan.micro_batch, self.window
            if self._stage.shape[0] < n * mb:  # grown: views of the old one are rebuilt
                self._stage = np.empty((n * mb, w), dtype=self.dtype)
                self._stages.clear()
            stage = self._stage[: n * mb]
            block = stage.reshape(n, mb, w)
            got = (memoryview(stage).cast("B"), stage, block[:, :, :-1], block[:, :, 1:])
            self._stages[n] = got
        return got

    def fill_pair(
        self, q: int, inputs: np.ndarray, labels: np.ndarray, *, shift: bool = True, n: int = 1
    ) -> None:
        """Write the inputs and labels of micro-batches ``q .. q+n-1`` (``n`` up to
        ``group_end``) into ``inputs[:n]`` and ``labels[:n]``, C-contiguous int64 blocks of
        ``[>= n, micro, seq_len]`` (labels shifted by one, or, with ``shift=False``, equal
        to the inputs): ``stage`` (unless ``stage(q, n, ahead=True)`` did already), then
        ``widen``."""
        if self.staged != (q, n):
            self.stage(q, n)
        self.widen(n, inputs, labels, shift=shift)

    def stage(self, q: int, n: int, *, ahead: bool = False) -> bool:
        """Gather the windows of micro-batches ``q .. q+n-1`` (``n`` up to ``group_end``)
        into the staging buffer, in the token dtype, and check their ids. ``ahead``: a
        look-ahead, done while earlier micro-batches wait to be handed over, which gives
        up (returns False, nothing staged) instead of opening a shard not mapped yet (a
        fetch can take long) or raising (the error is raised by the read that needs it)."""
        self.staged = None
        stage_bytes, stage, _, _ = self._stage_for(n)
        if not ahead:
            self.fill(q, stage, stage_bytes, n=n)
        else:
            try:
                if self.fill(q, stage, stage_bytes, n=n, open_new=False) < 0:
                    return False
            except Exception:
                return False
        self.staged = (q, n)
        return True

    def widen(self, n: int, inputs: np.ndarray, labels: np.ndarray, *, shift: bool) -> None:
        """The staged group's inputs and labels into ``inputs[:n]``, ``labels[:n]``: two
        casts for the whole group, two numpy calls a group instead of two per sample
        (measured: 15.7 vs 17.0 us per 8 x 2048 micro-batch one micro-batch at a time;
        the casts vectorise better than row by row). Equal labels are cast from the narrow
        windows too, not copied from the wide inputs: a quarter of the bytes read for
        uint16 tokens. Each cast releases the GIL while it runs."""
        _, _, src_inputs, src_next = self._stage_for(n)
        if n == inputs.shape[0]:  # a whole block: no slicing
            inputs[...] = src_inputs
            labels[...] = src_next if shift else src_inputs
        else:
            inputs[:n] = src_inputs
            labels[:n] = src_next if shift else src_inputs

    def sample_ids_group(self, q: int, n: int) -> np.ndarray:
        """``[n, micro]`` global sample ids of micro-batches ``q .. q+n-1`` (in one chunk)."""
        chunk = self._chunk_for(q)
        mb = self.plan.micro_batch
        a = (q - chunk.lo) * mb
        return chunk.refs.sample_id[a : a + n * mb].reshape(n, mb)

    def fill(
        self,
        q: int,
        out: np.ndarray,
        out_bytes: memoryview | None = None,
        *,
        n: int = 1,
        open_new: bool = True,
    ) -> int:
        """Copy the windows of micro-batches ``q .. q+n-1`` (``n`` up to ``group_end``)
        into ``out[row]``, a C-contiguous ``[n * micro, seq_len + 1]`` array of
        ``self.dtype`` (``out_bytes``: its bytes, if the caller keeps them); returns bytes
        read, or -1 when ``open_new`` is false and a shard not mapped yet is needed."""
        chunk = self._chunk_for(q)
        mb = self.plan.micro_batch
        a = (q - chunk.lo) * mb
        b = a + n * mb
        assert b <= CHUNK * mb, "a group crosses a chunk: see group_end"
        views = self._views
        rows = zip(chunk.slots[a:b], chunk.offsets[a:b], strict=True)
        if self._bytes:
            dst = memoryview(out).cast("B") if out_bytes is None else out_bytes
            size, start = self._row_bytes, 0
            for slot, o in rows:
                self._current = slot
                src = views[slot]
                if src is None:  # first use of this shard: map (or fetch) it
                    if not open_new:
                        self._current = None
                        return -1
                    src = self._open(slot)
                dst[start : start + size] = src[o : o + size]
                start += size
        else:  # datasets of several dtypes: numpy widens the narrower ones
            w = self.window
            for row, (slot, o) in enumerate(rows):
                self._current = slot
                view = views[slot]
                if view is None:
                    if not open_new:
                        self._current = None
                        return -1
                    view = self._open(slot)
                out[row] = view[o : o + w]
        self._current = None
        if self._check_ids and _MAX(out, None) >= self._id_limit:
            for j in range(n):  # in order: the first micro-batch with a bad id is named
                self._check_token_ids(q + j, out[j * mb : (j + 1) * mb])
        if self._fixed_nbytes is not None:
            return self._fixed_nbytes * n
        return sum(self.nbytes(q + j) for j in range(n))

    def _check_token_ids(self, q: int, out: np.ndarray) -> None:
        """Find the first id of micro-batch ``q`` outside its dataset's vocabulary and raise
        an error naming the shard file and the token offset in it (a blend of datasets with
        different vocabularies reaches here when an id is only valid for another one)."""
        refs = self.refs(q)
        limits = self._vocabs[refs.dataset]
        bad_rows = np.nonzero(out.max(axis=1) >= limits)[0]
        if not bad_rows.size:
            return
        row = int(bad_rows[0])
        col = int(np.argmax(out[row] >= limits[row]))
        d, s = int(refs.dataset[row]), int(refs.shard[row])
        ds = self.datasets[d]
        info = ds.manifest.shards[s]
        store = getattr(ds, "store", None)
        where = store.display(info.name) if store is not None else info.name
        raise DatasetError(
            f"{where}: token id {int(out[row, col])} at token offset "
            f"{int(refs.offset[row]) + col} is outside the vocabulary [0, {int(limits[row])}) "
            f"of the manifest (shard {s}); the shard is damaged or not this dataset's: run "
            f"`steadytrain verify {getattr(ds, 'url', where)}`, then restore or re-tokenize it"
        )


def cache_counts(datasets: Sequence[Any]) -> tuple[int, int]:
    """Node-cache hits and misses of ``datasets`` since the previous call (in this process)."""
    hits = misses = 0
    for ds in datasets:
        stats = getattr(getattr(ds, "cache", None), "stats", None)
        if callable(stats):
            st = stats()
            hits += int(st.get("hits", 0))
            misses += int(st.get("misses", 0))
    return hits, misses


def worker_main(
    datasets: Sequence[Any],
    sampler: Sampler,
    plan: BatchPlan,
    worker: int,
    num_workers: int,
    q0: int,
    conn: Any,
) -> None:
    """Produce micro-batches ``q >= q0`` with ``q % num_workers == worker``, forever.

    The pipe's capacity is the back-pressure: ``send_bytes`` blocks while the loader is
    behind. The loader ends a worker by terminating it.
    """
    reader = Reader(datasets, sampler, plan)
    buf = np.empty((plan.micro_batch, reader.window), dtype=reader.dtype)
    q = q0 + (worker - q0) % num_workers
    try:
        while True:
            t0 = time.perf_counter()
            nbytes = reader.fill(q, buf)
            hits, misses = cache_counts(datasets)
            header = HEADER.pack(q, time.perf_counter() - t0, nbytes, 0, hits, misses)
            conn.send_bytes(header + buf.tobytes())
            q += num_workers
    except (BrokenPipeError, EOFError, OSError) as exc:
        if isinstance(exc, (BrokenPipeError, EOFError)):
            return  # the loader closed its end: stop quietly
        _send_error(conn, q, exc)
    except BaseException as exc:  # report to the loader, which raises it in the trainer
        _send_error(conn, q, exc)


def _send_error(conn: Any, q: int, exc: BaseException) -> None:
    try:
        payload = pickle.dumps(exc)
    except Exception:
        payload = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    try:
        conn.send_bytes(HEADER.pack(q, 0.0, 0, 1, 0, 0) + payload)
    except OSError:
        pass  # the loader is gone: nobody to tell
