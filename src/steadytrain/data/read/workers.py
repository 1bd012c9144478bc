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
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from steadytrain.data.read.sampler import BatchPlan, Refs, Sampler
from steadytrain.errors import DatasetError

# q (micro-batch index), read seconds, bytes read, flag (0 data, 1 pickled exception),
# node-cache hits and misses in this worker since its previous message (the worker's own
# ShardCache counts them, out of the loader's sight otherwise)
HEADER = struct.Struct("<qdqBII")
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
        # assignment (measured: 7.8-9.0 vs 10.3-10.7 us per 8 x 2048 micro-batch). But it
        # holds the GIL through each copy, where numpy releases it: a background thread
        # beside the training loop passes byte_copies=False (measured there: 3.0 vs 2.5
        # CPU ns/token for the pair of threads with byte copies).
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
        # Reused staging windows in the token dtype (``fill_pair``): the per-sample copies
        # stay small, and the widening to int64 runs as two whole-batch casts.
        self._stage = np.empty((plan.micro_batch, self.window), dtype=self.dtype)
        self._stage_bytes = memoryview(self._stage).cast("B")
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

    def fill_pair(
        self, q: int, inputs: np.ndarray, labels: np.ndarray, *, shift: bool = True
    ) -> int:
        """Write micro-batch ``q``'s inputs and labels from the maps (labels shifted by one,
        or, with ``shift=False``, equal to the inputs); returns bytes read. Windows are
        gathered in the token dtype first, then widened by two whole-batch casts: two numpy
        calls instead of two per sample (measured: 15.7 vs 17.0 us per 8 x 2048
        micro-batch; the casts vectorise better than row by row). Equal labels are cast
        from the narrow windows too, not copied from the wide inputs: a quarter of the
        bytes read for uint16 tokens."""
        stage = self._stage
        nbytes = self.fill(q, stage, self._stage_bytes)
        inputs[...] = stage[:, :-1]
        labels[...] = stage[:, 1:] if shift else stage[:, :-1]
        return nbytes

    def fill(self, q: int, out: np.ndarray, out_bytes: memoryview | None = None) -> int:
        """Copy micro-batch ``q``'s windows into ``out[row]``, a C-contiguous
        ``[micro, seq_len + 1]`` array of ``self.dtype`` (``out_bytes``: its bytes, if the
        caller keeps them); returns bytes read."""
        chunk = self._chunk_for(q)
        mb = self.plan.micro_batch
        a = (q - chunk.lo) * mb
        views = self._views
        rows = zip(chunk.slots[a : a + mb], chunk.offsets[a : a + mb], strict=True)
        if self._bytes:
            dst = memoryview(out).cast("B") if out_bytes is None else out_bytes
            n, start = self._row_bytes, 0
            for slot, o in rows:
                self._current = slot
                src = views[slot]
                if src is None:  # first use of this shard: map (or fetch) it
                    src = self._open(slot)
                dst[start : start + n] = src[o : o + n]
                start += n
        else:  # datasets of several dtypes: numpy widens the narrower ones
            w = self.window
            for row, (slot, o) in enumerate(rows):
                self._current = slot
                view = views[slot]
                if view is None:
                    view = self._open(slot)
                out[row] = view[o : o + w]
        self._current = None
        if self._check_ids and int(out.max()) >= self._id_limit:
            self._check_token_ids(q, out)
        return self._fixed_nbytes if self._fixed_nbytes is not None else self.nbytes(q)

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
