"""``ThreadedSink``: a slow sink (MLflow) behind a thread and a queue of its own.

Opening the MLflow sink imports ``mlflow`` and creates or opens a SQLite store: seconds, more
under load; each of its flushes is a SQLite transaction. In the meter's one writer thread
that time held up the ledger: ``Run`` flushes the attempt's ``job_start`` before step 1, and
that flush waited for every sink to open (an in-place replacement paid 1.5-5 s in its first
step). Here the meter's writer hands such a sink each processed batch by a queue ``put`` and
goes on: the ledger (``JsonlSink``, written in the writer thread as before) never waits for
it, neither at start-up nor on a crash's ``job_end``.

The sink is made in this thread (lazily: the meter never waits for it) and then gets every
batch in the order the ledger got them, those queued while it was opening first. The queue
is bounded (``MAX_BACKLOG_RECORDS``): past it, new batches are dropped and counted, never the
ledger's. ``close`` waits a bounded time for the thread to hand over its backlog and close
the sink, and says so in the log when it stops waiting (the thread goes on in the background
until the process exits; the ledger has every record).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "CLOSE_WAIT_S",
    "CRASH_CLOSE_WAIT_S",
    "MAX_BACKLOG_RECORDS",
    "OPEN_WAIT_S",
    "ThreadedSink",
    "close_wait_s",
]

log = logging.getLogger("steadytrain.monitor")

# Records queued at most (a few kB each): hours of steps at 10 steps/s while a tracking
# server is down, and a bound on the memory it can take.
MAX_BACKLOG_RECORDS = 50_000
# How long ``close`` waits for the sink: after a clean end, long enough for a store that is
# slow under load; after a crash, short, so a failed attempt's process leaves promptly (its
# restart waits for it) -- its ledger's job_end is written before either wait.
CLOSE_WAIT_S = 60.0
CRASH_CLOSE_WAIT_S = 5.0
# After a clean end, a sink still opening gets this long to open first (then CLOSE_WAIT_S):
# under load, MLflow's import and store took over 60 s here, and a job that ends cleanly
# loses nothing by waiting for it (before this thread, its start-up waited for the open).
OPEN_WAIT_S = 240.0
CLEAN_ENDS = ("finished", "interpreter_exit")  # the job_end reasons that are no crash

_STOP = object()


class ThreadedSink:
    """A sink made by ``make()`` in a thread of its own; ``write`` only queues."""

    def __init__(self, name: str, make: Callable[[], Any], tick_s: float = 0.25) -> None:
        self.name = name
        self._make = make
        self._tick_s = tick_s
        self._q: queue.Queue[Any] = queue.Queue()
        self._queued = 0  # records in the queue (bounded by MAX_BACKLOG_RECORDS)
        self._lock = threading.Lock()
        self.dropped = 0  # records never handed to the sink (backlog full, or it failed)
        self.sink: Any = None
        self.failed = False
        self._opened = threading.Event()  # made, or failed to be: nothing left to open
        self._live: dict[str, Any] = {}
        self._thread = threading.Thread(
            target=self._run, name=f"steadytrain-meter-{name}", daemon=True
        )
        self._thread.start()

    # -- the meter's writer thread ---------------------------------------------------------
    def write(self, records: list[dict[str, Any]], live: dict[str, Any]) -> None:
        self._put("records", records, dict(live))

    def log_rank_windows(self, rows: list[dict[str, Any]]) -> None:
        self._put("rank_windows", rows, None)

    def tick(self, live: dict[str, Any]) -> None:
        self._live = dict(live)  # the thread ticks the sink itself between batches

    def close(self, reason: str = "finished") -> None:
        """Hand the sink what is queued and close it, waiting at most ``CLOSE_WAIT_S``
        (``CRASH_CLOSE_WAIT_S`` after a crash; after a clean end, a sink still opening first
        gets up to ``OPEN_WAIT_S`` to open); say so when it stops waiting."""
        self._q.put((_STOP, reason, None))
        t0 = time.monotonic()
        wait_s = CLOSE_WAIT_S if reason in CLEAN_ENDS else CRASH_CLOSE_WAIT_S
        if reason in CLEAN_ENDS and not self._opened.wait(OPEN_WAIT_S):
            wait_s = 0.0  # still not open: nothing would be handed over in time
        self._thread.join(wait_s)
        wait_s = time.monotonic() - t0
        if self._thread.is_alive():
            state = "still opening" if self.sink is None and not self.failed else "still busy"
            log.warning(
                "meter sink %r %s after %.0f s: not waiting for it any longer (%d records "
                "queued for it; the ledger has every record). It goes on in the background "
                "until the process exits.",
                self.name,
                state,
                wait_s,
                self._queued,
            )
        elif self.dropped:
            log.warning("meter sink %r missed %d records", self.name, self.dropped)

    def _put(self, kind: str, items: list[dict[str, Any]], live: dict[str, Any] | None) -> None:
        if self.failed or not items:
            return
        with self._lock:
            if self._queued + len(items) > MAX_BACKLOG_RECORDS:
                if not self.dropped:
                    log.warning(
                        "meter sink %r is %d records behind: dropping its new records until "
                        "it catches up (the ledger keeps every record)",
                        self.name,
                        self._queued,
                    )
                self.dropped += len(items)
                return
            self._queued += len(items)
        self._q.put((kind, items, live))

    # -- its own thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.sink = self._make()
        except Exception:
            log.exception("meter sink %r could not start; continuing without it", self.name)
            self._fail()
            return
        finally:
            self._opened.set()
        while not self.failed:
            try:
                kind, items, live = self._q.get(timeout=self._tick_s)
            except queue.Empty:
                self._call("tick", self._live)
                continue
            if kind is _STOP:
                self._call("close", items)
                return
            with self._lock:
                self._queued -= len(items)
            if kind == "records":
                self._call("write", items, live)
            else:
                self._call("log_rank_windows", items)

    def _call(self, method: str, *args: Any) -> None:
        fn = getattr(self.sink, method, None)
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:
            log.exception("meter sink %r failed in %s; switching it off", self.name, method)
            self._fail()

    def _fail(self) -> None:
        """Switched off: what is queued and what comes later is dropped (and counted)."""
        self.failed = True
        with self._lock:
            self.dropped += self._queued
            self._queued = 0


def close_wait_s(reason: str) -> float:
    """The longest a ``ThreadedSink.close(reason)`` waits: what the meter's writer, which
    calls it, must wait for beyond its own drain."""
    if reason in CLEAN_ENDS:
        return OPEN_WAIT_S + CLOSE_WAIT_S
    return CRASH_CLOSE_WAIT_S
