"""A rank that SIGTERM cannot reach: record the end and exit, instead of waiting to be killed.

torchrun's agent stops the survivors of a failed attempt with SIGTERM, then SIGKILL after
its grace (30 s by default); Slurm does the same with ``KillWait``. ``Run`` turns SIGTERM
into ``Terminated`` in the main thread (run_support.SignalGuard), but Python runs a signal
handler only between bytecodes: a main thread inside a C++ call -- a gloo collective whose
peer was stopped, measured here: no exit in 40 s -- never sees it, so the attempt's teardown
lasts the whole grace and its end is never recorded (issue 44).

``StuckExit`` is woken by the signal itself: ``signal.set_wakeup_fd`` makes the interpreter's
C-level handler write the signal number to a socket, from whichever thread the kernel
interrupted, while the Python handler still waits for the main thread. A small thread reads
that socket. If ``exit_s`` seconds later the main thread's Python handler has not run and
``Run``'s close has not begun, the main thread is stuck: the thread records the crash
(``job_end`` ``signal: SIGTERM``, flushed, as the ordered close would) and exits with 128 +
the signal number, as the signal would have.

How long is stuck: ``exit_s``, or ``patience()`` when that is longer -- ``Run`` gives twice
the longest interval between two of its steps so far, so a step whose C++ calls are long (a
big forward pass on CPU, an evaluation) reaches its next bytecode, and a loop that catches
``Terminated`` to save on preemption saves, before it is judged stuck.

Do no harm: a loop at a step boundary handles the signal itself within milliseconds and
closes in order as before (its in-flight save finishes and commits; a loop that catches
``Terminated`` to save first is left to it); a save running in the background keeps the
watcher waiting until it is done (a save stuck on a dead peer is then bounded by the
launcher's SIGKILL, as before); the fd is taken only when nobody else holds it (asyncio, a
framework), else nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["StuckExit"]

_POLL_S = 0.05


class StuckExit:
    """See the module docstring. ``exit_s``: how long the main thread may take to react to
    the signal; ``abandon(signum)``: records the end (called on the watcher thread, with
    the lock that ``closing()`` takes held), then the process exits; ``busy()``: True while
    a background save is in flight; ``reacted()``: True once the main thread's own handler
    ran (it is not stuck: a loop that catches the signal to save first is left alone);
    ``patience()``: seconds the main thread may legitimately need (the wait is the longer of
    it and ``exit_s``)."""

    def __init__(
        self,
        exit_s: float,
        abandon: Callable[[int], None],
        busy: Callable[[], bool] = lambda: False,
        reacted: Callable[[], bool] = lambda: False,
        signals: tuple[int, ...] = (signal.SIGTERM,),
        patience: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.exit_s, self._abandon, self._busy, self._signals = exit_s, abandon, busy, signals
        self._patience = patience
        self._reacted = reacted
        self._lock = threading.Lock()
        self._closing = False
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Watch (main thread only). False when not watching: ``exit_s`` 0, not the main
        thread, or another owner of the wakeup fd."""
        if self.exit_s <= 0 or threading.current_thread() is not threading.main_thread():
            return False
        r, w = socket.socketpair()
        w.setblocking(False)
        previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # someone else's (asyncio's loop): leave it to them
            signal.set_wakeup_fd(previous)
            r.close()
            w.close()
            return False
        self._pair = (r, w)
        self._thread = threading.Thread(target=self._watch, name="steadytrain-sigterm", daemon=True)
        self._thread.start()
        return True

    def _watch(self) -> None:
        r = self._pair[0] if self._pair else None
        while r is not None:
            try:
                got = r.recv(64)
            except OSError:
                return
            if not got:
                return  # stop() closed the pair
            signum = next((s for s in got if s in self._signals), None)
            if signum is None:
                continue
            deadline = time.monotonic() + max(self.exit_s, self._patience())
            while time.monotonic() < deadline or self._busy():
                if self._closing or self._reacted():
                    return  # the main thread reacted: its ordered close does the rest
                time.sleep(_POLL_S)
            with self._lock:
                if self._closing:
                    return
                self._closing = True
                try:
                    self._abandon(signum)
                finally:
                    os._exit(128 + signum)

    def closing(self) -> None:
        """The main thread begins its ordered close: the watcher stands down. Blocks while
        the watcher is recording (it then exits the process)."""
        with self._lock:
            self._closing = True

    def stop(self) -> None:
        """Give the wakeup fd back and end the thread (main thread)."""
        if self._pair is None:
            return
        with contextlib.suppress(ValueError):  # not the main thread: the fd stays ours
            signal.set_wakeup_fd(-1)
        r, w = self._pair
        self._pair = None
        with contextlib.suppress(OSError):
            r.shutdown(socket.SHUT_RDWR)
        w.close()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        r.close()
