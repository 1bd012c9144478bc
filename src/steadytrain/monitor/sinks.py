"""Where meter records go: the JSONL ledger, MLflow (``mlflow_sink``), a live rich console.

Nothing here runs in the training loop. The meter puts each record on a queue
(``BackgroundWriter.put``, a ``SimpleQueue.put``: well under a microsecond); one daemon
thread drains the queue in batches, lets the meter fold them into goodput and alerts, and
hands each batch to every sink. ``close()`` puts a sentinel, the thread drains what is left,
closes the sinks and is joined. A sink that raises is logged and switched off, never
silently and never at the cost of the training job.

Sinks are chosen by name (``SINKS``) or passed as objects with ``write(records, live)``
and ``close()``.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from steadytrain.monitor.ledger import Ledger
from steadytrain.monitor.mlflow_sink import MlflowSink

__all__ = ["BackgroundWriter", "JsonlSink", "MlflowSink", "ConsoleSink", "SINKS", "make_sink"]

log = logging.getLogger("steadytrain.monitor")

_SENTINEL = object()


class BackgroundWriter:
    """One thread, one queue, batches; ``process(batch)`` runs in the thread."""

    def __init__(
        self,
        process: Callable[[list[dict[str, Any]]], None],
        tick: Callable[[], None],
        on_start: Callable[[], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        interval_s: float = 0.25,
        max_batch: int = 4096,
    ) -> None:
        self._on_start = on_start
        self._on_stop = on_stop
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._process = process
        self._tick = tick
        self._interval = interval_s
        self._max = max_batch
        self._flushed = threading.Condition()
        self._wake = threading.Event()
        self._done_seq = 0
        self._put_seq = 0
        self._thread = threading.Thread(target=self._run, name="steadytrain-meter", daemon=True)
        self._thread.start()

    def put(self, rec: Any) -> None:
        self._put_seq += 1
        self._q.put(rec)

    def flush(self, timeout: float = 30.0) -> None:
        """Block until everything put so far has reached the sinks (tests, reports)."""
        target = self._put_seq
        self._wake.set()
        with self._flushed:
            self._flushed.wait_for(lambda: self._done_seq >= target, timeout=timeout)

    def close(self, timeout: float = 60.0) -> None:
        self._q.put(_SENTINEL)
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("meter writer did not finish within %.0f s; records may be lost", timeout)

    def _run(self) -> None:
        # Opening sinks (importing mlflow, creating its SQLite store) takes seconds: do it
        # here so the training job's start-up does not pay for it; records queue meanwhile.
        if self._on_start is not None:
            self._safe(self._on_start)
        stop = False
        while not stop:
            # Sleep, then drain: waking on every put() would make the thread compete with
            # the training loop for the GIL right after each step; flush()/close() wake it.
            self._wake.wait(self._interval)
            self._wake.clear()
            batch: list[dict[str, Any]] = []
            while len(batch) < self._max:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is _SENTINEL:
                    stop = True
                    break
                batch.append(item)
            if len(batch) >= self._max:
                self._wake.set()  # more is waiting: do not sleep before the next batch
            if batch:
                self._safe(lambda b=batch: self._process(b))
            else:
                self._safe(self._tick)
            with self._flushed:
                self._done_seq += len(batch)
                self._flushed.notify_all()
        self._safe(self._tick)
        if self._on_stop is not None:
            self._safe(self._on_stop)

    @staticmethod
    def _safe(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # the training job must outlive a broken sink; say so loudly
            log.exception("steadytrain meter: processing a record batch failed")


class JsonlSink:
    """The ledger itself: every record, fsync'd at checkpoint commits and job end."""

    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike[str], **_: Any) -> None:
        self.ledger = Ledger(run_dir)

    def write(self, records: list[dict[str, Any]], live: dict[str, Any]) -> None:
        durable = any(r.get("type") in ("checkpoint", "job_end") for r in records)
        self.ledger.write(records, durable=durable)

    def close(self, reason: str = "finished") -> None:
        self.ledger.close()


class ConsoleSink:
    """A live rich view: progress, tokens/s, goodput, data wait, ETA, the latest alert."""

    name = "console"

    def __init__(
        self,
        console: Any = None,
        total_steps: int | None = None,
        refresh_s: float = 0.5,
        **_: Any,
    ) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = console if console is not None else Console(stderr=True)
        self.total = total_steps
        self.refresh_s = refresh_s
        self._last = 0.0
        self._live_state: dict[str, Any] = {}
        self.live = Live(
            self._render(),
            console=self.console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start()

    def _render(self) -> Any:
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        from steadytrain.printable import printable

        s = self._live_state
        t = Table.grid(padding=(0, 2))
        step = s.get("step", 0)
        if self.total:
            t.add_row("progress", ProgressBar(total=self.total, completed=step, width=40))
        eta = s.get("eta_s")
        t.add_row("step", f"{step}" + (f" / {self.total}" if self.total else ""))
        t.add_row("tokens/s", f"{s.get('tokens_per_s', 0):,.0f}")
        gp = s.get("goodput")
        t.add_row("goodput", "-" if gp is None else f"{gp:.1%}")
        t.add_row("data wait", f"{s.get('data_wait_share', 0):.1%} of step time")
        t.add_row("ETA", "-" if eta is None else f"{eta / 60:.1f} min")
        if s.get("last_alert"):
            # A Text, not markup: brackets in an alert are shown as they are, and so are the
            # control characters of a record's text (printable)
            t.add_row("[red]alert[/red]", Text(printable(s["last_alert"])))
        return t

    def write(self, records: list[dict[str, Any]], live: dict[str, Any]) -> None:
        self._live_state = live
        now = time.monotonic()
        if now - self._last >= self.refresh_s:
            self._last = now
            self.live.update(self._render(), refresh=True)

    def tick(self, live: dict[str, Any]) -> None:
        self.write([], live)

    def close(self, reason: str = "finished") -> None:
        self.live.update(self._render(), refresh=True)
        self.live.stop()


def offscreen_console(width: int = 100) -> Any:
    """A rich console that renders into memory (benchmarks, tests)."""
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, width=width)


SINKS: dict[str, type] = {"jsonl": JsonlSink, "mlflow": MlflowSink, "console": ConsoleSink}


def make_sink(spec: Any, **context: Any) -> Any:
    """A sink from a name in ``SINKS`` or an object that already has ``write``/``close``."""
    if isinstance(spec, str):
        try:
            cls = SINKS[spec]
        except KeyError:
            from steadytrain.errors import ConfigError

            raise ConfigError(
                f"unknown meter sink {spec!r}: choose from {sorted(SINKS)} or pass an object "
                "with write(records, live) and close()"
            ) from None
        return cls(**context)
    if not (hasattr(spec, "write") and hasattr(spec, "close")):
        from steadytrain.errors import ConfigError

        raise ConfigError(f"meter sink {spec!r} needs write(records, live) and close() methods")
    return spec
