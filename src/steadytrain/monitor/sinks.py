"""Where meter records go: the JSONL ledger, MLflow, a live rich console view.

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
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadytrain.monitor.ledger import Ledger

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


class MlflowSink:
    """MLflow through ``MlflowClient`` (no global active run; safe from a thread).

    Default store: ``sqlite:///RUN_DIR/mlflow.db``. The MLflow run id is kept in
    ``RUN_DIR/mlflow_run.json`` so every attempt of a job logs into the same MLflow run.
    Per step (or, when steps are faster than ``every_s``, one point per ``every_s`` holding
    the mean per step; ``checkpoint_block_s`` summed): ``loss``, ``tokens_per_s``,
    ``fetch_seconds``, ``checkpoint_block_s``, ``step_s``, ``compute_s``, ``rss_bytes``,
    ``shm_bytes``, ``goodput`` (the run's goodput so far, all attempts); every
    ``window_s``: the Databricks DataLoader names ``dataloader/fetch_seconds/rank_{R}`` and
    ``dataloader/between_next_seconds/rank_{R}`` (window means) with ``..._variance``
    companions; alerts as tags ``alert.<step>.<kind>``.
    """

    name = "mlflow"
    STEP_METRICS = {
        "loss": "loss",
        "data_wait_s": "fetch_seconds",
        "checkpoint_block_s": "checkpoint_block_s",
        "step_s": "step_s",
        "compute_s": "compute_s",
        "rss_bytes": "rss_bytes",
        "shm_bytes": "shm_bytes",
    }

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        tracking_uri: str | None = None,
        experiment: str = "steadytrain",
        run_name: str | None = None,
        rank: int = 0,
        every_s: float = 0.5,
        window_s: float = 10.0,
        flush_s: float = 5.0,
        **_: Any,
    ) -> None:
        from mlflow.entities import RunStatus
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir)
        self.uri = tracking_uri or f"sqlite:///{self.run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.rank = rank
        self.every_s = every_s
        self.window_s = window_s
        self.flush_s = flush_s
        self._status = RunStatus
        self.run_id = self._open_run(experiment, run_name or self.run_dir.name)
        self._metrics: list[Any] = []
        self._tags: dict[str, str] = {}
        self._last_flush = time.monotonic()
        self._win = [0, 0.0, 0.0, 0.0, 0.0]  # n, fetch sum, fetch sq, between sum, between sq
        self._win_start = time.monotonic()
        self._last_step = 0
        self._agg: dict[str, Any] = {"n": 0}
        self._emit_t = 0.0
        self._live: dict[str, Any] = {}

    def _open_run(self, experiment: str, run_name: str) -> str:
        marker = self.run_dir / "mlflow_run.json"
        if marker.exists():
            saved = json.loads(marker.read_text())
            if saved.get("tracking_uri") == self.uri:
                self.client.update_run(saved["run_id"], status="RUNNING")
                return str(saved["run_id"])
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=run_name)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": self.uri}))
        os.replace(tmp, marker)
        return str(run.info.run_id)

    def write(self, records: list[dict[str, Any]], live: dict[str, Any]) -> None:
        for r in records:
            kind = r.get("type")
            if kind == "step":
                self._add_step(r)
                if r["t"] - self._emit_t >= self.every_s:
                    self._emit(live)
            elif kind == "alert":
                key = f"alert.{r.get('step')}.{r.get('kind')}"
                self._tags[key] = json.dumps(
                    {k: r.get(k) for k in ("message", "diagnosis", "next")}
                )[:5000]
            elif kind == "job_start":
                key = f"attempt.{r.get('attempt')}.restored_step"
                self._tags[key] = str(r.get("restored_step"))
        self._live = live
        self._maybe_window(int(time.time() * 1000))
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def _add_step(self, r: dict[str, Any]) -> None:
        a = self._agg
        a["n"] += 1
        a["step"] = int(r.get("step", 0))
        a["t"] = r["t"]
        for key in ("loss", "data_wait_s", "checkpoint_block_s", "step_s", "compute_s"):
            v = r.get(key)
            if v is not None:
                a[key] = a.get(key, 0.0) + float(v)
                a[key + "#n"] = a.get(key + "#n", 0) + 1
        a["tokens"] = a.get("tokens", 0) + int(r.get("tokens") or 0)
        for key in ("rss_bytes", "shm_bytes"):
            if r.get(key) is not None:
                a[key] = float(r[key])  # a level, not a rate: the latest sample
        fetch = float(r.get("data_wait_s") or 0.0)
        between = max(0.0, float(r.get("step_s") or 0.0) - fetch)
        w = self._win
        w[0] += 1
        w[1] += fetch
        w[2] += fetch * fetch
        w[3] += between
        w[4] += between * between

    def _emit(self, live: dict[str, Any]) -> None:
        """One point per metric for the steps since the last point (every step when steps
        are slower than ``every_s``): means per step, ``checkpoint_block_s`` summed."""
        from mlflow.entities import Metric

        a = self._agg
        if not a["n"]:
            return
        ts, step = int(a["t"] * 1000), a["step"]
        self._last_step = step
        self._emit_t = a["t"]
        out = self._metrics
        for key, name in self.STEP_METRICS.items():
            if key in ("rss_bytes", "shm_bytes"):
                if key in a:
                    out.append(Metric(name, a[key], ts, step))
            elif key in a:
                value = a[key] if key == "checkpoint_block_s" else a[key] / a[key + "#n"]
                out.append(Metric(name, value, ts, step))
        if a.get("step_s"):
            out.append(Metric("tokens_per_s", a["tokens"] / a["step_s"], ts, step))
        if live.get("goodput") is not None:
            out.append(Metric("goodput", float(live["goodput"]), ts, step))
        self._agg = {"n": 0}

    def _maybe_window(self, ms: int, force: bool = False) -> None:
        from mlflow.entities import Metric

        n = self._win[0]
        if n == 0 or (not force and time.monotonic() - self._win_start < self.window_s):
            return
        _, fs, fq, bs, bq = self._win
        for name, s, q in (("fetch_seconds", fs, fq), ("between_next_seconds", bs, bq)):
            mean = s / n
            var = max(0.0, q / n - mean * mean)
            step = self._last_step
            self._metrics.append(Metric(f"dataloader/{name}/rank_{self.rank}", mean, ms, step))
            self._metrics.append(
                Metric(f"dataloader/{name}_variance/rank_{self.rank}", var, ms, step)
            )
        self._win = [0, 0.0, 0.0, 0.0, 0.0]
        self._win_start = time.monotonic()

    def tick(self, live: dict[str, Any]) -> None:
        if time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        from mlflow.entities import RunTag

        self._last_flush = time.monotonic()
        metrics, self._metrics = self._metrics, []
        tags, self._tags = self._tags, {}
        tag_list = [RunTag(k, v) for k, v in tags.items()]
        for i in range(0, max(len(metrics), 1), 1000):  # log_batch takes at most 1000 metrics
            chunk = metrics[i : i + 1000]
            if chunk or (i == 0 and tag_list):
                self.client.log_batch(self.run_id, metrics=chunk, tags=tag_list if i == 0 else [])

    def close(self, reason: str = "finished") -> None:
        self._emit(self._live)
        self._maybe_window(int(time.time() * 1000), force=True)
        self.flush()
        status = "FINISHED" if reason == "finished" else "FAILED"
        self.client.set_terminated(self.run_id, status=status)


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
            t.add_row("[red]alert[/red]", s["last_alert"])
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
