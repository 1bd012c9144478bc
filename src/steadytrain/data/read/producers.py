"""Background producers of micro-batches: one thread, or worker processes over pipes.

Both hand the loader ``(q, batch, read_s, bytes_read)`` tuples strictly in order of ``q``
(or the exception that stopped them) through a bounded queue, and have an explicit
lifecycle: ``close()`` stops the thread at its next micro-batch and kills the workers.

A loader dropped without ``close()`` must not leave threads and processes behind (as
torch's DataLoader does not). Two things make that hold:

- nothing a background thread runs holds the loader or the producer strongly: the thread
  runs a module-level function over the resources only, and the loader's ``read`` /
  ``finish`` methods are held through ``weakref.WeakMethod``, so dropping the loader frees it
  (and its ``__del__`` closes the producer) even while the thread is blocked;
- the resources (stop flag, thread, worker processes, pipes) are shut down by a
  ``weakref.finalize`` on the producer, which also runs at interpreter exit (a daemon thread
  killed inside torch code aborts the process: "terminate called without an active
  exception"), and whichever of ``close()``, the loader's ``__del__``, garbage collection
  or exit comes first does it once.
"""

from __future__ import annotations

import _thread
import collections
import inspect
import multiprocessing
import pickle
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from steadytrain.data.read.sampler import BatchPlan, Sampler
from steadytrain.data.read.workers import HEADER, Reader, worker_main

# finish(q, raw windows, reader) -> batch: the loader's tensor assembly from worker bytes.
Finish = Callable[[int, np.ndarray, Reader], Any]
# read(q, n, reader) -> [(batch, bytes read), ...]: the loader's read of micro-batches q, q+1,
# ... (up to n, at least one) from the maps.
Read = Callable[[int, int, Reader], list[tuple[Any, int]]]

_THREAD_JOIN_S = 1.0  # a thread stuck inside a read is a daemon: it is not waited for longer
_PROCESS_JOIN_S = 5.0  # after SIGKILL a worker exits at once; the bound guards a stuck kernel


class _OwnerGone(Exception):
    """The loader whose method a background thread calls was collected: stop quietly."""


def _weak(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without a strong reference to its object, when it is a bound method: a
    thread calling the loader's ``_read`` must not be what keeps the loader alive."""
    if not inspect.ismethod(fn):
        return fn
    ref = weakref.WeakMethod(fn)

    def call(*args: Any) -> Any:
        method = ref()
        if method is None:
            raise _OwnerGone
        return method(*args)

    return call


def _detach(exc: BaseException) -> BaseException:
    """Clear the local variables of the finished frames in ``exc``'s tracebacks (file, line
    and function stay for the message). An exception handed to the training loop crosses
    threads; its frames' locals include the loader (``self`` of ``_read``), and a loader
    that is dropped instead of iterated must not be kept alive by its pending error."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips frames still running
        stack += [e.__cause__, e.__context__]
    return exc


def _shutdown(
    q: _Queue | _Handoff,
    thread: threading.Thread | None,
    procs: Sequence[Any] = (),
    conns: Sequence[Any] = (),
) -> None:
    """Stop a producer's resources: the ``weakref.finalize`` callback, so it must not refer
    to the producer. It may run on the producer's own thread (the loader's last reference
    can be dropped there, or garbage collection can run there): a thread never joins itself."""
    q.close()
    for proc in procs:
        proc.kill()  # holds nothing but maps; SIGKILL also ends a stopped process
    for proc in procs:
        proc.join(timeout=_PROCESS_JOIN_S)
    for conn in conns:
        conn.close()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=_THREAD_JOIN_S)


class _Queue:
    """A bounded queue whose producer gives up when asked to stop."""

    def __init__(self, depth: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()

    def put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout: float) -> Any:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break


def _wake(lock: Any) -> None:
    try:
        lock.release()
    except RuntimeError:  # already released (a wake-up raced a time-out): one is pending
        pass


class _Handoff:
    """Items from the reading thread to the training loop, with one wake-up per group.

    A deque carries the items (``append`` and ``popleft`` are atomic under the GIL: no lock
    per item). A side sleeps only when it must (the trainer on an empty deque, the reader on
    a full one), each on a lock of its own, and the other side wakes it once ``group`` items
    are ready or ``group`` places free: one wake-up per group of micro-batches, and no lock
    at all for the items in between. With the ``queue.Queue`` of groups this replaces, the
    training thread spent ~6.4 us of CPU a micro-batch in ``get`` (groups of 4, 16k tokens a
    micro-batch, thread_time); now ~4.4-5.2 us in the waits that sleep (one per group, each
    ~20 us with the GIL hand-over: ``bench/loader_profile.py``) and ~0.3 us in the others.
    A sleeper also wakes on its time-out and looks again, so a wake-up lost to a race costs
    at most one time-out; a spurious one costs a look.
    """

    def __init__(self, capacity: int, group: int) -> None:
        self.items: collections.deque = collections.deque()
        self.capacity, self.group = capacity, group
        self.stop = threading.Event()
        self.stopped = False  # stop.is_set(), read without a call on the reading thread
        self._reader_sleeps = self._trainer_sleeps = False
        self._wake_reader, self._wake_trainer = _thread.allocate_lock(), _thread.allocate_lock()
        self._wake_reader.acquire()  # held: acquire() sleeps until the other side releases
        self._wake_trainer.acquire()

    def put(self, item: Any, *, now: bool = False) -> bool:
        """Append ``item`` (``now``: wake the trainer for it, e.g. an error); sleep while
        the deque is full. False once stopped."""
        self.items.append(item)
        return self.published(now=now)

    def published(self, *, now: bool = False) -> bool:
        """After items were appended to ``items`` (a group at once): wake the trainer if it
        sleeps and a group is ready (``now``: in any case), then sleep while the deque is
        full. False once stopped."""
        items = self.items
        if self._trainer_sleeps and (now or len(items) >= self.group):
            self._trainer_sleeps = False
            _wake(self._wake_trainer)
        while len(items) >= self.capacity:
            if self.stop.is_set():
                return False
            self._reader_sleeps = True
            if len(items) >= self.capacity:  # looked again after saying so: no lost wake-up
                self._wake_reader.acquire(timeout=0.1)
            self._reader_sleeps = False
        return not self.stop.is_set()

    def get(self, timeout: float) -> Any:
        """The next item, or None after ``timeout`` s without one."""
        items = self.items
        if not items:
            self._trainer_sleeps = True
            if not items:
                self._wake_trainer.acquire(timeout=timeout)
            self._trainer_sleeps = False
            if not items:
                return None
        item = items.popleft()
        if self._reader_sleeps and self.capacity - len(items) >= self.group:
            self._reader_sleeps = False
            _wake(self._wake_reader)
        return item

    def close(self) -> None:
        self.stopped = True
        self.stop.set()
        self.items.clear()
        _wake(self._wake_reader)


class ThreadProducer:
    """Reads micro-batches ``q0, q0+1, ...`` on one daemon thread (``num_workers=0``).

    Up to ``2 * group`` micro-batches wait ready (``group = min(depth, 8)``, at least
    ``depth``), and the threads wake each other once per group (``_Handoff``): every
    wake-up between threads costs a few microseconds of CPU, comparable at 16k tokens a
    micro-batch to the copy itself. The thread also reads a group per call (``_read_loop``).
    """

    def __init__(self, reader: Reader, read: Read, q0: int, depth: int) -> None:
        self._reader = reader
        group = max(1, min(depth, 8))
        self._q = _Handoff(max(depth, 2 * group), group)
        self._thread = threading.Thread(
            target=_read_loop,
            args=(self._q, reader, _weak(read), q0),
            name="steadytrain-loader",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._q, self._thread)
        self.get = self._q.get  # get(timeout): one call less a micro-batch

    @staticmethod
    def capacity(depth: int) -> int:
        """Micro-batches that can wait ready at once for a ``depth``."""
        return max(depth, 2 * max(1, min(depth, 8)))

    def current(self) -> tuple[int, int] | None:
        return self._reader.current

    def close(self) -> None:
        # A thread stuck inside a read cannot be interrupted; it is a daemon and will
        # exit at its next micro-batch boundary (or with the process).
        self._finalizer()


def _read_loop(q: _Handoff, reader: Reader, read: Read, q0: int) -> None:
    """The thread of a ``ThreadProducer``: holds the hand-off, the reader and a weak ``read``.
    Reads a group of micro-batches per call (one gather and one cast each for inputs and
    labels, ``batches.read_group``) and hands it over at once. A group whose read fails is
    read again one micro-batch at a time, so the micro-batches before the failing one are
    delivered and the error is raised at its own index, as without groups."""
    clock, items, group = time.perf_counter, q.items, q.group
    try:
        while True:
            t0 = clock()
            try:
                made = read(q0, group, reader)
            except _OwnerGone:
                raise
            except Exception:
                made = read(q0, 1, reader)  # raises at the failing micro-batch itself
            read_s = (clock() - t0) / len(made)
            for batch, nbytes in made:
                items.append((q0, batch, read_s, nbytes))
                q0 += 1
            if not q.published():
                return
    except _OwnerGone:
        return  # the loader was dropped: nobody is reading
    except BaseException as exc:  # handed to the training loop, raised there
        q.put(_detach(exc), now=True)


class ProcessProducer:
    """``num_workers`` spawned processes; worker ``q % num_workers`` reads micro-batch ``q``.

    A collector thread receives the raw token bytes in order of ``q`` and turns them into
    tensors, so at most ``depth`` finished batches plus one message per pipe are in flight.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        sampler: Sampler,
        plan: BatchPlan,
        num_workers: int,
        q0: int,
        depth: int,
        finish: Finish,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._refs = Reader(datasets, sampler, plan)
        self.cache = [0, 0]  # node-cache hits, misses counted inside the workers (totals)
        self._procs, self._conns = [], []
        self._q = _Queue(depth)
        try:
            for worker in range(num_workers):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(datasets, sampler, plan, worker, num_workers, q0, send),
                    name=f"steadytrain-loader-{worker}",
                    daemon=True,
                )
                self._conns.append(recv)
                proc.start()
                send.close()  # the child holds the only write end: EOF when it dies
                self._procs.append(proc)
        except BaseException:  # e.g. an unpicklable dataset: end the workers already started
            _shutdown(self._q, None, self._procs, self._conns)
            raise
        self._thread = threading.Thread(
            target=_collect,
            args=(self._q, self._conns, self._procs, self._refs, _weak(finish), q0, self.cache),
            name="steadytrain-loader-collect",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._q, self._thread, self._procs, self._conns
        )

    def get(self, timeout: float) -> Any:
        return self._q.get(timeout)

    def current(self) -> tuple[int, int] | None:
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        self._finalizer()


def _collect(
    q: _Queue,
    conns: Sequence[Any],
    procs: Sequence[Any],
    refs: Reader,
    finish: Finish,
    at: int,
    counts: list[int],
) -> None:
    """The collector thread of a ``ProcessProducer``: receives micro-batch ``at, at+1, ...``
    from worker ``at % len(conns)`` and assembles it with a weak ``finish``."""
    shape = (refs.plan.micro_batch, refs.window)
    n = len(conns)
    try:
        while not q.stop.is_set():
            worker = at % n
            try:
                msg = conns[worker].recv_bytes()
            except (EOFError, OSError):
                if q.stop.is_set():
                    return
                procs[worker].join(timeout=1.0)
                code = procs[worker].exitcode
                raise RuntimeError(
                    f"loader worker {worker} exited unexpectedly (exit code {code}; "
                    f"-9 usually means it was killed for memory; see its traceback above "
                    f"on stderr: a script that starts a loader with num_workers > 0 needs "
                    f"an `if __name__ == '__main__':` guard, as workers are spawned)"
                ) from None
            got, read_s, nbytes, flag, hits, misses = HEADER.unpack_from(msg)
            counts[0] += hits  # one writer (this thread); the loader reads the totals
            counts[1] += misses
            if flag:
                raise pickle.loads(memoryview(msg)[HEADER.size :])
            raw = np.frombuffer(msg, dtype=refs.dtype, offset=HEADER.size)
            batch = finish(got, raw.reshape(shape), refs)
            if not q.put((got, batch, read_s, nbytes)):
                return
            at += 1
    except _OwnerGone:
        return  # the loader was dropped: the finalizer ends the workers
    except BaseException as exc:
        q.put(_detach(exc))
