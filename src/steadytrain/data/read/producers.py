"""Background producers of micro-batches: one thread, or worker processes over pipes.

Both hand the loader ``(q, batch, read_s, bytes_read)`` tuples strictly in order of ``q``
(or the exception that stopped them) through a bounded queue, and have an explicit
lifecycle: ``close()`` stops the thread at its next micro-batch and kills the workers.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from steadytrain.data.read.sampler import BatchPlan, Sampler
from steadytrain.data.read.workers import HEADER, Reader, worker_main

# Producers still running at interpreter exit are stopped first: a daemon thread killed
# inside torch code aborts the process ("terminate called without an active exception").
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for producer in list(_LIVE):
        producer.close()


# finish(q, raw windows, reader) -> batch: the loader's tensor assembly from worker bytes.
Finish = Callable[[int, np.ndarray, Reader], Any]
# read(q, reader) -> (batch, bytes read): the loader's read of a micro-batch from the maps.
Read = Callable[[int, Reader], tuple[Any, int]]


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


class ThreadProducer:
    """Reads micro-batches ``q0, q0+1, ...`` on one daemon thread (``num_workers=0``).

    Micro-batches travel in groups (a list per queue item): every hand-off between threads
    costs a few wake-ups, which at 16k tokens a micro-batch is comparable to the copy itself.
    """

    def __init__(self, reader: Reader, read: Read, q0: int, depth: int) -> None:
        self._reader, self._read = reader, read
        self._group = max(1, min(depth, 8))
        self._q = _Queue(max(1, depth // self._group))
        self._ready: collections.deque = collections.deque()
        self._thread = threading.Thread(
            target=self._run, args=(q0,), name="steadytrain-loader", daemon=True
        )
        self._thread.start()
        _LIVE.add(self)

    def _run(self, q: int) -> None:
        group: list = []
        try:
            while not self._q.stop.is_set():
                t0 = time.perf_counter()
                batch, nbytes = self._read(q, self._reader)
                group.append((q, batch, time.perf_counter() - t0, nbytes))
                q += 1
                if len(group) == self._group:
                    if not self._q.put(group):
                        return
                    group = []
        except BaseException as exc:  # handed to the training loop, raised there
            if group:
                self._q.put(group)
            self._q.put(exc)

    def get(self, timeout: float) -> Any:
        if not self._ready:
            item = self._q.get(timeout)
            if not isinstance(item, list):
                return item  # None (nothing yet) or the producer's exception
            self._ready.extend(item)
        return self._ready.popleft()

    def current(self) -> tuple[int, int] | None:
        return self._reader.current

    def close(self) -> None:
        # A thread stuck inside a read cannot be interrupted; it is a daemon and will
        # exit at its next micro-batch boundary (or with the process).
        self._q.close()
        self._thread.join(timeout=1.0)


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
        self._finish = finish
        self._procs, self._conns = [], []
        for worker in range(num_workers):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                args=(datasets, sampler, plan, worker, num_workers, q0, send),
                name=f"steadytrain-loader-{worker}",
                daemon=True,
            )
            proc.start()
            send.close()  # the child holds the only write end: EOF when it dies
            self._procs.append(proc)
            self._conns.append(recv)
        self._q = _Queue(depth)
        self._thread = threading.Thread(
            target=self._collect, args=(q0,), name="steadytrain-loader-collect", daemon=True
        )
        self._thread.start()
        _LIVE.add(self)

    def _collect(self, q: int) -> None:
        shape = (self._refs.plan.micro_batch, self._refs.window)
        n = len(self._conns)
        try:
            while not self._q.stop.is_set():
                worker = q % n
                try:
                    msg = self._conns[worker].recv_bytes()
                except (EOFError, OSError):
                    if self._q.stop.is_set():
                        return
                    self._procs[worker].join(timeout=1.0)
                    code = self._procs[worker].exitcode
                    raise RuntimeError(
                        f"loader worker {worker} exited unexpectedly (exit code {code}; "
                        f"-9 usually means it was killed for memory; see its traceback above "
                        f"on stderr: a script that starts a loader with num_workers > 0 needs "
                        f"an `if __name__ == '__main__':` guard, as workers are spawned)"
                    ) from None
                got, read_s, nbytes, flag = HEADER.unpack_from(msg)
                if flag:
                    raise pickle.loads(memoryview(msg)[HEADER.size :])
                raw = np.frombuffer(msg, dtype=self._refs.dtype, offset=HEADER.size)
                batch = self._finish(got, raw.reshape(shape), self._refs)
                if not self._q.put((got, batch, read_s, nbytes)):
                    return
                q += 1
        except BaseException as exc:
            self._q.put(exc)

    def get(self, timeout: float) -> Any:
        return self._q.get(timeout)

    def current(self) -> tuple[int, int] | None:
        return None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        self._q.close()
        for proc in self._procs:
            proc.kill()  # holds nothing but maps; SIGKILL also ends a stopped process
        for proc in self._procs:
            proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._thread.join(timeout=1.0)
