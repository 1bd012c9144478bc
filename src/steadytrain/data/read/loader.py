"""``TokenLoader``: micro-batches of a pure, resumable sample order, prefetched in background.

The order comes from ``Sampler`` (position -> sample) and ``BatchPlan`` (step -> rank slice
-> micro-batches), so the loader's state is a cursor plus the settings that define the order.
Background work runs on one thread (``num_workers=0``) or in worker processes that hold only
memory maps and integers and send raw token bytes over pipes (``workers.py``). Every wait of
the training loop is measured (``last_data_wait_s``), and a read that does not finish within
``read_timeout_s`` becomes a ``ReadDeadlineError`` naming the files it was reading. Every
setting lives in ``LoaderConfig`` (the ``[data]`` table of a training config extends it).
What the trainer sees (the labels convention, the ``IterableDataset`` face) is ``faces.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from steadytrain.data.read.batches import finish, read_group
from steadytrain.data.read.blend import quantise_weights
from steadytrain.data.read.faces import LABELS, TokenIterableDataset
from steadytrain.data.read.loader_state import check_state, log_changes, make_state
from steadytrain.data.read.modes import MODES
from steadytrain.data.read.producers import ProcessProducer, ThreadProducer
from steadytrain.data.read.sampler import BatchPlan, Sampler
from steadytrain.data.read.workers import Reader, cache_counts
from steadytrain.errors import ConfigError, ReadDeadlineError
from steadytrain.settings import InvalidSetting, check, merge

__all__ = ["TokenLoader", "LoaderConfig"]

_POLL_S = 0.05


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """Everything a ``TokenLoader`` can be told, with the one copy of each default and
    check. Topology (``rank``, ``world_size``) and ``seed`` are the run's, passed apart."""

    seq_len: int  # tokens per sample
    global_batch: int  # samples per optimizer step, all ranks together
    micro_batch: int  # samples per forward/backward on one rank
    # "same": labels == input_ids (HF causal-LM models shift inside); "next": shifted by one
    labels: Literal["next", "same"] = "same"
    shuffle: str = "global"  # an order of data/read/modes: global, block, sequential
    shuffle_settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # the mode's
    num_workers: int = 0  # worker processes (0: one background thread)
    prefetch: int = 4  # micro-batches read ahead (0: read inside next(), synchronously)
    pin_memory: bool = False  # page-locked batches (CUDA only)
    read_timeout_s: float | None = None  # a micro-batch slower than this is an error
    startup_timeout_s: float = 120.0  # the first read after (re)starting workers may take this
    weights: list[float] | None = None  # blend several datasets (None: equal weights)
    blend_period: int | None = None  # positions per blend period (None: from the weights)
    return_doc_ids: bool = False  # add "doc_ids" (document index within each sample)
    return_position_ids: bool = False  # add "position_ids" (restart at each document)
    allow_dataset_change: bool = False  # load a state saved on other data (else refused)

    def __post_init__(self) -> None:
        check(self.seq_len >= 1, "seq_len", self.seq_len, "use at least 1")
        check(self.micro_batch >= 1, "micro_batch", self.micro_batch, "use at least 1")
        check(
            self.global_batch >= 1 and self.global_batch % self.micro_batch == 0,
            "global_batch",
            self.global_batch,
            f"use a positive multiple of micro_batch ({self.micro_batch})",
        )
        check(
            self.labels in LABELS,
            "labels",
            self.labels,
            'use "same" (labels equal input_ids, for models that shift inside, e.g. Hugging '
            'Face causal LMs) or "next" (labels already shifted, for models that do not)',
        )
        check(self.shuffle in MODES, "shuffle", self.shuffle, f"choose one of {sorted(MODES)}")
        check(self.num_workers >= 0, "num_workers", self.num_workers, "use 0 (a thread) or more")
        check(self.prefetch >= 0, "prefetch", self.prefetch, "use 0 (synchronous) or more")
        if self.read_timeout_s is not None:
            check(self.read_timeout_s > 0, "read_timeout_s", self.read_timeout_s, "use > 0")
        check(self.startup_timeout_s > 0, "startup_timeout_s", self.startup_timeout_s, "use > 0")
        if self.prefetch == 0:
            check(
                not self.num_workers and self.read_timeout_s is None,
                "prefetch",
                0,
                "prefetch=0 reads synchronously inside next(): it cannot use worker processes "
                "or enforce read_timeout_s; use prefetch >= 1 for either",
            )
        if self.weights is not None:
            self.weights = list(self.weights)  # any sequence given: one JSON-able form
            try:  # the blend's own rules, checked now rather than at the first batch
                quantise_weights(self.weights, self.blend_period)
            except ConfigError as exc:
                raise InvalidSetting("weights", self.weights, str(exc)) from None


class TokenLoader:
    """Infinite iterator of ``{"input_ids", "labels", "sample_ids"}`` micro-batches.

    ``ds`` is a ``TokenDataset`` or a list of them blended with ``weights``. Each rank reads
    ``global_batch // world_size`` samples per step in micro-batches of ``micro_batch``.

    **Labels: by default ``labels`` EQUAL ``input_ids`` (``labels="same"``)**, the convention
    of Hugging Face causal-LM models, which shift inside their loss. A model that does not
    shift (predicts ``labels[t]`` from ``input_ids[:t+1]``, like ``train/model.py``) needs
    ``labels="next"``: labels are the inputs shifted by one (the token after each). Mixing
    them up trains silently on the wrong token (t+2, or a copy of the input).

    **Gradient accumulation**: ``micro_per_step`` (``global_batch // world_size //
    micro_batch``) micro-batches make one optimizer step on this rank; run forward/backward
    on that many ``next()`` results, then step. ``step`` counts whole steps.

    **Buffers**: inputs and labels are filled into a small ring of reused int64 blocks
    (``BufferRing``), a group of micro-batches at a time with the widening cast fused into
    the one copy (``batches.py``). A batch stays the trainer's for as long as it holds it,
    or any tensor or view of it: a block is refilled only once nothing outside the loader
    refers to it (reference counts, no call needed), and a trainer that keeps many batches
    just gets fresh blocks.

    ``pin_memory=True`` pins batches (when CUDA is available); ``device=`` moves each batch
    there on ``next()``, ``non_blocking`` when pinned. ``as_dataset()`` is the
    ``IterableDataset`` face for ``DataLoader``/``StatefulDataLoader`` (``faces.py``).
    """

    def __init__(
        self,
        ds: Any,
        seq_len: int | None = None,
        global_batch: int | None = None,
        micro_batch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: str | None = None,
        num_workers: int | None = None,
        *,
        weights: Sequence[float] | None = None,
        shuffle_settings: dict[str, Any] | None = None,
        blend_period: int | None = None,
        prefetch: int | None = None,
        pin_memory: bool | None = None,
        read_timeout_s: float | None = None,
        startup_timeout_s: float | None = None,
        return_doc_ids: bool | None = None,
        return_position_ids: bool | None = None,
        allow_dataset_change: bool | None = None,
        labels: str | None = None,
        device: str | torch.device | None = None,
        on_step: Callable[[int], None] | None = None,
        config: LoaderConfig | None = None,
    ) -> None:
        self.datasets = list(ds) if isinstance(ds, (list, tuple)) else [ds]
        cfg = merge(LoaderConfig, config, locals())
        self.config = cfg
        seq_len, global_batch, micro_batch = cfg.seq_len, cfg.global_batch, cfg.micro_batch
        shuffle, num_workers, prefetch = cfg.shuffle, cfg.num_workers, cfg.prefetch
        self.sampler = Sampler(
            self.datasets,
            seq_len,
            global_batch,
            seed=seed,
            mode=shuffle,
            mode_settings=cfg.shuffle_settings,
            weights=cfg.weights,
            blend_period=cfg.blend_period,
        )
        self.plan = BatchPlan(global_batch, micro_batch, rank, world_size)
        self._micro_per_step = self.plan.micro_per_step  # read on every next(): a plain int
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.num_workers, self.prefetch = num_workers, prefetch
        self.pin_memory = cfg.pin_memory and torch.cuda.is_available()
        self.labels = cfg.labels
        # Not a LoaderConfig field: where batches go is the process's choice, not the run's.
        self.device = torch.device(device) if device is not None else None
        self.read_timeout_s = cfg.read_timeout_s
        # The first micro-batch after (re)starting also waits for worker processes to
        # import and map their shards: it gets at least this long.
        self.startup_timeout_s = cfg.startup_timeout_s
        self._first_after_start = False
        self.return_doc_ids, self.return_position_ids = cfg.return_doc_ids, cfg.return_position_ids
        self.allow_dataset_change = cfg.allow_dataset_change
        self.on_step = on_step
        self._cursor = 0  # this rank's micro-batches handed out so far
        self._producer: ThreadProducer | ProcessProducer | None = None
        self._refs = Reader(self.datasets, self.sampler, self.plan)  # main-thread lookups
        self.last_data_wait_s = 0.0
        self._reads: collections.deque[float] = collections.deque(maxlen=1024)
        self._bytes_total, self._wait_total, self._read_total = 0, 0.0, 0.0
        # (micro-batches, bytes, wait, read time) at the last metrics()
        self._baseline: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)
        self._between_total, self._between_base = 0.0, 0.0  # time the caller spent between
        self._last_return: float | None = None  # ... next() calls, and when next() returned
        # The workers' cache counters (their producer's list) and (hits, misses) at the
        # last metrics() call.
        self._worker_cache_base: tuple[Any, int, int] = (None, 0, 0)
        self._handed = 0  # micro-batches handed out by this object (not reset by a resume)
        self._face: TokenIterableDataset | None = None  # as_dataset()
        # What the last load_state_dict changed (e.g. the global batch), for the ledger.
        self.resume_changes: list[dict[str, Any]] = []

    # -- position ----------------------------------------------------------------------
    @property
    def micro_per_step(self) -> int:
        """Micro-batches per optimizer step on this rank: the gradient-accumulation count."""
        return self._micro_per_step

    @property
    def step(self) -> int:
        """The step the next micro-batch belongs to (steps completed at a step boundary)."""
        return self._cursor // self._micro_per_step

    @property
    def position(self) -> int:
        """Stream position of the start of the current step (``step * global_batch``, or
        from the saved position on after a resume with another global batch)."""
        return self.plan.step_start(self.step)

    def shards_for_steps(self, start: int, stop: int, **kw: Any) -> list[tuple[int, int]]:
        """The sampler's look-ahead (``Sampler.shards_for_steps``), for a cache prefetcher."""
        kw.setdefault("origin", (self.plan.origin_step, self.plan.origin_position))
        return self.sampler.shards_for_steps(start, stop, **kw)

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> TokenLoader:
        return self

    def as_dataset(self) -> TokenIterableDataset:
        """This loader as an ``IterableDataset`` for ``DataLoader(batch_size=None,
        num_workers=0)`` or torchdata's ``StatefulDataLoader``; its state is this loader's.
        One per loader: it notes what it handed out (``TokenIterableDataset.consumed``)."""
        if self._face is None:
            self._face = TokenIterableDataset(self)
        return self._face

    def __next__(self) -> dict[str, torch.Tensor]:
        # Runs once a micro-batch on the training thread: locals over attributes, one clock
        # read on entry and one on return (measured: ~1.5 us a call of bookkeeping).
        q = self._cursor
        clock = time.perf_counter
        t0 = clock()
        if self._last_return is not None:
            self._between_total += t0 - self._last_return
        if not self.prefetch:  # synchronous: the read is the wait
            batch, nbytes = self._read(q, 1, self._refs)[0]
            wait = read_s = clock() - t0
        else:
            producer = self._producer
            if producer is None:  # starting it is part of the wait: it is counted
                producer = self._producer = self._start(q)
                self._first_after_start = self.num_workers > 0
            item = producer.get(_POLL_S)
            if item is None or isinstance(item, BaseException):
                item = self._wait_for(q, t0, item)
            got_q, batch, read_s, nbytes = item
            self._first_after_start = False
            wait = clock() - t0
            assert got_q == q, f"loader produced micro-batch {got_q}, expected {q}"
        self.last_data_wait_s = wait
        if self.on_step is not None and q % self._micro_per_step == 0:
            self.on_step(q // self._micro_per_step)
        self._cursor = q + 1
        self._handed += 1
        self._reads.append(read_s)
        self._bytes_total += nbytes
        self._wait_total += wait
        self._read_total += read_s
        if self.device is not None:  # on the caller's thread: its current CUDA stream
            batch = {k: v.to(self.device, non_blocking=self.pin_memory) for k, v in batch.items()}
        self._last_return = clock()
        return batch

    def _wait_for(
        self, q: int, t0: float, item: Any = None
    ) -> tuple[int, dict[str, torch.Tensor], float, int]:
        assert self._producer is not None
        while True:
            if item is None:
                item = self._producer.get(_POLL_S)
            if item is not None:
                if isinstance(item, BaseException):
                    self.close()
                    raise item
                return item
            waited = time.perf_counter() - t0
            limit = self.read_timeout_s
            if limit is not None and self._first_after_start:
                limit = max(limit, self.startup_timeout_s)
            if limit is not None and waited > limit:
                message = self._stall_message(q, waited)
                self.close()
                raise ReadDeadlineError(message)

    def _stall_message(self, q: int, waited: float) -> str:
        refs = self._refs.refs(q)
        names = []
        for d, s in sorted(set(zip(refs.dataset.tolist(), refs.shard.tolist(), strict=True))):
            ds = self.datasets[d]
            names.append(ds.store.display(ds.manifest.shards[s].name))
        current = self._producer.current() if self._producer is not None else None
        now = ""
        if current is not None:
            d, s = current
            now = f"; stuck reading {self.datasets[d].store.display(self.datasets[d].manifest.shards[s].name)}"
        return (
            f"rank {self.rank}: micro-batch {q} (step {q // self._micro_per_step}) was not "
            f"read within read_timeout_s={self.read_timeout_s} (waited {waited:.1f} s); it reads "
            f"{', '.join(names)}{now}. The storage or the shard cache is not answering: check "
            f"it, or raise read_timeout_s if reads are merely slow"
        )

    def _start(self, q0: int) -> ThreadProducer | ProcessProducer:
        if self.num_workers == 0:
            # byte copies on the thread too: see Reader (the GIL changes hands per group)
            reader = Reader(self.datasets, self.sampler, self.plan)
            return ThreadProducer(reader, self._read, q0, self.prefetch)
        return ProcessProducer(
            self.datasets,
            self.sampler,
            self.plan,
            self.num_workers,
            q0,
            self.prefetch,
            self._finish,
        )

    def _read(self, q: int, n: int, reader: Reader) -> list[tuple[dict[str, torch.Tensor], int]]:
        """Micro-batches ``q, q+1, ...`` (up to ``n``) read from the maps, in-process or on
        the thread (``n > 1``: with a look-ahead), each with the bytes it read
        (``batches.read_group``)."""
        return read_group(self, q, n, reader, ahead=n > 1)

    def _finish(self, q: int, raw: np.ndarray, reader: Reader) -> dict[str, torch.Tensor]:
        """Micro-batch ``q`` from a worker's raw ``[micro, seq_len + 1]`` windows."""
        return finish(self, q, raw, reader)

    # -- measurements ------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters since the previous call (one call per step gives per-step values),
        ``*_total`` since construction, and read-time percentiles of the last 1024 reads."""
        reads = np.fromiter(self._reads, dtype=np.float64) if self._reads else np.zeros(1)
        n0, b0, w0, r0 = self._baseline
        micro = self._handed - n0
        out: dict[str, float] = {
            "micro_batches": micro,
            "samples": micro * self.micro_batch,
            "tokens": micro * self.micro_batch * self.seq_len,
            "bytes_read": self._bytes_total - b0,
            "data_wait_s": self._wait_total - w0,
            # the reads' own time (a worker's or the prefetch thread's, overlapped or not):
            # slow storage shows here; a wait with reads as fast as ever is the loader's
            "read_s": self._read_total - r0,
            "micro_batches_total": self._handed,
            "samples_total": self._handed * self.micro_batch,
            "bytes_read_total": self._bytes_total,
            "data_wait_s_total": self._wait_total,
            "read_p50_s": float(np.percentile(reads, 50)),
            "read_p99_s": float(np.percentile(reads, 99)),
            "last_data_wait_s": self.last_data_wait_s,
            # Databricks' between_next_seconds: the caller's time between next() calls
            "between_next_s": self._between_total - self._between_base,
        }
        self._between_base = self._between_total
        self._baseline = (self._handed, self._bytes_total, self._wait_total, self._read_total)
        hits, misses = cache_counts(self.datasets)  # reads on this process's own threads
        totals = getattr(self._producer, "cache", None)  # ... and inside worker processes
        if totals is not None:
            owner, h0, m0 = self._worker_cache_base
            if owner is not totals:  # a new producer (a seek or a resume): counts from 0
                h0 = m0 = 0
            hits, misses = hits + totals[0] - h0, misses + totals[1] - m0
            self._worker_cache_base = (totals, totals[0], totals[1])
        out["cache_hits"], out["cache_misses"] = hits, misses
        return out

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: a cursor and the settings that define the order."""
        return make_state(self)

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise ``LoaderStateError`` if ``state_dict`` would not load; changes nothing (a
        restore checks every small state this way before it writes any live tensor)."""
        check_state(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved stream position in O(1), with this loader's global batch from
        there on; refuses a state that defines another order."""
        resume = check_state(self, state_dict)
        self.close()
        self.plan = resume.plan  # anchored at the saved (step, sample position)
        self._refs = Reader(self.datasets, self.sampler, self.plan)  # it caches positions
        self._cursor = resume.cursor
        self.resume_changes = resume.changes
        log_changes(resume.changes)

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop the background thread or worker processes (a later next() restarts them)."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    def __del__(self) -> None:
        # A loader dropped without close() (partly iterated, then abandoned, as a script or
        # an exception often leaves it) stops its thread and workers here, as torch's
        # DataLoader iterator does. The producer holds this loader only weakly, so being
        # dropped is what happens; its own finalizer covers a loader caught in a cycle.
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TokenLoader(step={self.step}, seq_len={self.seq_len}, global_batch="
            f"{self.global_batch}, micro_batch={self.micro_batch}, rank={self.rank}/"
            f"{self.world_size}, shuffle={self.shuffle!r}, workers={self.num_workers})"
        )
