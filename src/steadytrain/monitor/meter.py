"""``GoodputMeter``: the training loop's one handle on the goodput ledger.

A loop usually holds ``steadytrain.Run`` (run.py), which owns a meter and wires it as it
must be: the checkpointer's restore event is recorded after ``job_start`` (before it, the
new process's time would end the previous attempt and the restart gap would read 0),
``startup_s`` counts from the process's birth, and a crash ends with a crash ``job_end``.
By hand:

    meter = GoodputMeter(run_dir, rank=rank, world_size=world,
                         expected_tokens_per_s=(13_500, 14_000),
                         sinks=("jsonl", "mlflow", "console"))
    meter.job_start(restored_step=step, startup_s=startup_s, restore_s=restore_s)
    for step in range(step + 1, total + 1):
        t0 = time.perf_counter(); batch = next(it); t1 = time.perf_counter()
        loss = train_step(batch); t2 = time.perf_counter()
        block = ckpt.maybe_save(step, states)
        meter.step(step, tokens=G * seq_len, data_wait_s=t1 - t0, compute_s=t2 - t1,
                   checkpoint_block_s=block, loss=loss.detach(), **loader.metrics())
    meter.close()

The hot path (``step``) builds one dict, samples process RSS and /dev/shm use every
``memory_every`` steps, and puts the dict on a queue: a few microseconds. Everything else
-- goodput arithmetic, alerts, JSON encoding, MLflow, the console -- runs in one background
thread (``sinks.BackgroundWriter``). Rank 0 keeps the job's ledger (``ledger.jsonl``:
goodput, alerts); every rank, rank 0 included, also appends its own compact step records to
``RUN_DIR/ranks/rank-RRRRR.jsonl`` (``monitor/ranks.py``; ``per_rank = false`` turns that
off), so a slow rank on another node is seen as itself. Pass ``loss`` as a tensor: it is converted in the background thread, so the loop never
waits for the device to produce it.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import time
import weakref
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from steadytrain.monitor.alerts import AlertConfig, AlertEngine, _band, warn_alert
from steadytrain.monitor.goodput import Breakdown, GoodputAccumulator
from steadytrain.monitor.ledger import (
    iter_ledger,
    ledger_path,
    load_snapshot,
    step_record,
    write_snapshot,
)
from steadytrain.monitor.memory import RssReader, shm_used_bytes
from steadytrain.monitor.meter_config import MeterConfig
from steadytrain.monitor.rank_recorder import RankPoller, RankRecorder, rank_windows
from steadytrain.monitor.records import MAX_INT, Rejects, finite_tree
from steadytrain.monitor.recovered import recovered_commit, recovered_steps
from steadytrain.monitor.sink_thread import ThreadedSink, close_wait_s
from steadytrain.monitor.sinks import BackgroundWriter, JsonlSink, make_sink
from steadytrain.monitor.straggler_live import StragglerCheck
from steadytrain.settings import merge

__all__ = ["GoodputMeter", "MeterConfig", "shm_used_bytes"]

log = logging.getLogger("steadytrain.monitor")

# Sinks that take seconds to open and to write (MLflow: its import, a SQLite store): each gets
# a thread and a queue of its own (monitor/sink_thread.py), so the ledger never waits for it.
SLOW_SINKS = ("mlflow",)


class GoodputMeter:
    """Records every step, checkpoint and restart of a job into ``RUN_DIR/ledger.jsonl``
    (rank 0) and each rank's own steps into ``RUN_DIR/ranks/`` (every rank)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int = 0,
        world_size: int = 1,
        expected_tokens_per_s: float | tuple[float, float] | None = None,
        sinks: Iterable[Any] | None = None,
        *,
        alert_config: AlertConfig | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        console: Any = None,
        total_steps: int | None = None,
        memory_every: int | None = None,
        flush_interval_s: float | None = None,
        sink_options: dict[str, Any] | None = None,
        snapshot_every: int | None = None,
        config: MeterConfig | None = None,
    ) -> None:
        cfg = merge(MeterConfig, config, {**locals(), "alerts": alert_config})
        self.config = cfg
        self.run_dir = Path(run_dir)
        # enabled: this meter keeps the job's ledger (rank 0); recording: it writes at all.
        self.rank, self.world_size, self.enabled = rank, world_size, rank == 0
        self.recording = self.enabled or cfg.per_rank
        self.alerts: deque[dict[str, Any]] = deque(maxlen=1000)
        self.live: dict[str, Any] = {}
        self._closed = False
        self.attempt = 0  # during start-up: the next attempt number seen in the ledger
        self._last_mono: float | None = None
        self._last_step = 0
        self._restored_step = 0  # this attempt's: no step up to it is this attempt's to record
        self._n = 0
        self.memory_every = cfg.memory_every
        self._ranks = RankRecorder(self.run_dir, rank, world_size, cfg.snapshot_every)
        self.node = self._ranks.node
        if not self.recording:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._rss = RssReader()
        ref = weakref.ref(self)
        self._atexit = lambda: (m := ref()) is not None and m.close("interpreter_exit")
        atexit.register(self._atexit)
        if not self.enabled:  # another rank: only its own file, from a background thread
            self._writer = BackgroundWriter(
                self._ranks.write,  # only its own file (the loss is rank 0's business)
                lambda: None,
                on_start=self._ranks.open,
                on_stop=self._ranks.close,
                interval_s=cfg.flush_interval_s,
            )
            return
        self._band = _band(cfg.expected_tokens_per_s)
        self.total_steps = total_steps
        self._acc = GoodputAccumulator()  # earlier attempts: goodput, attempts, last commit
        self._engine = AlertEngine(cfg.alerts, cfg.expected_tokens_per_s, world_size)
        self._last_ok_ckpt_t: float | None = None
        self.snapshot_every = cfg.snapshot_every
        self.snapshot_used = False  # start-up resumed from RUN_DIR/ledger.snapshot.json
        self.records_replayed = 0  # ledger records parsed at start-up
        self._load_history()
        self._engine.last_ckpt_t = self._last_ok_ckpt_t
        self._attempt_next = self.attempt
        self._since_snapshot = 0
        self._jsonl: JsonlSink | None = None
        self._sink_context = {
            "run_dir": self.run_dir,
            "rank": rank,
            "tracking_uri": cfg.tracking_uri,
            "experiment": cfg.experiment,
            "console": console,
            "total_steps": total_steps,
            **cfg.sink_options,  # e.g. window_s / flush_s for MLflow, refresh_s for console
        }
        self._sinks: list[Any] = []
        # Every straggler_every_s, rank 0's thread reads every rank's new records (the rank
        # files) for the per-rank MLflow windows and the live straggler check.
        self._poller: RankPoller | None = None
        if cfg.per_rank and cfg.straggler_every_s:
            self._poller = RankPoller(self.run_dir, cfg.straggler_every_s)
            self._poller.consumers.append(self._log_rank_windows)
            if world_size > 1:
                check = StragglerCheck(self.run_dir, cfg.alerts, raised=self.alerts)
                self._poller.consumers.append(check.consume)
        self._window: deque[tuple[int, float, float]] = deque(maxlen=20)
        self._close_reason = "finished"
        self._writer = BackgroundWriter(
            self._process,
            self._tick,
            on_start=self._open_sinks,
            on_stop=self._close_sinks,
            interval_s=cfg.flush_interval_s,
        )

    def _load_history(self) -> None:
        """Carry earlier attempts: from the snapshot plus the records after it, or (no
        valid snapshot) from the whole ledger. Alerts are not replayed: the engine starts
        fresh each attempt and only needs the time of the newest committed checkpoint."""
        lp = ledger_path(self.run_dir)
        self.rejected = Rejects()  # ledger records skipped as invalid (monitor/records.py)
        if not lp.exists():
            return
        offset = 0
        snap = load_snapshot(self.run_dir)
        if snap is not None:
            try:
                acc = GoodputAccumulator()
                acc.load_state_dict(snap[1]["goodput"])
                attempt = int(snap[1]["attempt_next"])
                last_ok = snap[1]["last_ok_ckpt_t"]
                # A snapshot is a cache: one with NaN, inf or a negative number in it is
                # not used (the ledger is read instead), so the live figures stay sane.
                if not (finite_tree(snap[1]) and 0 <= attempt < MAX_INT):
                    raise ValueError("a non-finite or out-of-range number")
                if last_ok is not None and not isinstance(last_ok, (int, float)):
                    raise TypeError("last_ok_ckpt_t is not a number")
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
                log.debug("ledger snapshot unusable (%s): reading the whole ledger", e)
            else:
                offset = snap[0]
                self._acc, self.attempt, self._last_ok_ckpt_t = acc, attempt, last_ok
                self.snapshot_used = True
        # The reader skips and counts every invalid record (monitor/records.py); whatever
        # else goes wrong, a restart must start: a ledger the meter cannot replay costs the
        # earlier attempts' figures, never the run.
        try:
            for rec in iter_ledger(lp, offset, rejects=self.rejected):
                self.records_replayed += 1
                self._acc.add(rec)
                self._note(rec)
        except Exception:
            log.exception(
                "%s could not be replayed past record %d; continuing with the history read so far",
                lp,
                self.records_replayed,
            )
        self._attempt_next = self.attempt

    def _note(self, rec: dict[str, Any]) -> None:
        # The two facts besides the accumulator that a restart takes from the ledger.
        kind = rec.get("type")
        if kind == "job_start":
            # The reader checked "attempt" is an integer; a job_start without one counts.
            self.attempt = max(self.attempt, int(rec.get("attempt", self.attempt)) + 1)
        elif kind == "checkpoint" and rec.get("ok", True):
            self._last_ok_ckpt_t = rec.get("t")

    # -- the training loop's API -----------------------------------------------------------
    def job_start(
        self,
        restored_step: int = 0,
        startup_s: float = 0.0,
        restore_s: float = 0.0,
        config: dict[str, Any] | None = None,
        device: str | None = None,
        attempt: int | None = None,
        run_nonce: str | None = None,
        restored_from: dict[str, Any] | None = None,
        restore_unknown: bool = False,
        startup_phases: dict[str, float] | None = None,
        born_t: float | None = None,
    ) -> None:
        """Mark the start of this attempt (after start-up and restore, before step 1).
        ``device`` ("cpu", "cuda"): what the ranks run on, so advice fits the hardware.
        ``attempt``: rank 0's ``meter.attempt`` broadcast to the other ranks (rank 0 counts
        attempts from the ledger; without it another rank uses torchrun's restart count).
        ``run_nonce``: the run's identity (``steadytrain.run_identity``), in rank 0's record.
        ``restored_from``: the checkpointer's ``restore`` event: a commit it proves that the
        ledger lacks is written back first (``monitor/recovered.py``).
        ``restore_unknown``: ``restored_step`` is the ledger's own position because the
        restore point is not known (a trainer that failed before it restored), not a step
        this attempt restored: no recovery point is made of it.
        ``startup_phases``: ``startup_s`` split into phases (``steadytrain.run_phases``);
        ``born_t``: this process's birth (both in this rank's ``rank_start`` too, so the
        report can tell when the last process of a failed attempt was gone and the first of
        the next one born)."""
        if not self.recording:
            return
        self._last_mono = time.monotonic()
        self._last_step = int(restored_step)
        self._restored_step = int(restored_step)
        if not self.enabled:
            if attempt is None:
                attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
            self.attempt = self._ranks.attempt = int(attempt)
            self._ranks.born_t = born_t
            self._writer.put(self._ranks.start_record(time.time(), device))
            return
        self._ranks.born_t = born_t
        self._ranks.attempt = self.attempt
        # what a SIGKILL took: the steps a restored checkpoint covers, and its commit
        for rec in recovered_steps(self._acc, int(restored_step)):
            self._writer.put(rec)
        for rec in recovered_commit(self._acc, restored_from):
            self._writer.put(rec)
        band = self._band
        self._writer.put(
            {
                "type": "job_start",
                "t": time.time(),
                "attempt": self.attempt,
                "world_size": self.world_size,
                "restored_step": int(restored_step),
                "startup_s": float(startup_s),
                "restore_s": float(restore_s),
                **({"startup_phases": dict(startup_phases)} if startup_phases else {}),
                **({"born_t": float(born_t)} if born_t is not None else {}),
                "config": dict(config or {}),
                "device": device,
                "run_nonce": run_nonce,
                "total_steps": self.total_steps,  # the job's state says "step N of M"
                **({"restore_unknown": True} if restore_unknown else {}),
                # JSON has no infinity: an open upper bound is stored as null.
                "expected_tokens_per_s": None
                if band is None
                else [band[0], None if band[1] == float("inf") else band[1]],
            }
        )

    def step(
        self,
        step: int,
        tokens: int,
        data_wait_s: float,
        compute_s: float,
        checkpoint_block_s: float = 0.0,
        loss: Any = None,
        eval_s: float = 0.0,
        **extra: Any,
    ) -> None:
        """Record one finished global step (``tokens``: tokens of the step over all ranks).
        ``eval_s``: seconds spent evaluating since the previous step (``Run`` passes the time
        inside its ``eval`` phases), kept out of ``data_wait_s``, ``compute_s`` and
        ``checkpoint_block_s``: the goodput breakdown books it as ``eval``.
        ``step`` is an integer (a numpy or torch integer too): anything else is refused here,
        in the caller's thread, not by a traceback in the meter's."""
        try:
            step = operator.index(step)
        except TypeError:
            raise TypeError(f"GoodputMeter.step(step={step!r}): a step is an integer") from None
        if not self.recording:
            return
        now = time.monotonic()
        if self._last_mono is None:  # job_start() was not called: start the clock here
            self.job_start(restored_step=max(0, step - 1))
            step_s = data_wait_s + compute_s + checkpoint_block_s + eval_s
        else:
            step_s = now - self._last_mono
        self._last_mono = now
        self._last_step = step
        t = time.time()
        rec = step_record(
            t, step, tokens, step_s, data_wait_s, compute_s, checkpoint_block_s, loss, eval_s
        )
        if extra:
            rec.update(extra)
        if self._n % self.memory_every == 0:
            rec["rss_bytes"] = self._rss()
            rec["shm_bytes"] = shm_used_bytes()
        self._n += 1
        self._writer.put(rec)

    def event(self, ev: dict[str, Any]) -> None:
        """Record a checkpoint / restore event (the Checkpointer's ``on_event``) or any
        other record with a ``type``. Safe to call from the checkpointer's threads. On a
        rank other than 0 only ``hang`` records are kept (in its rank file)."""
        if not self.recording:
            return
        rec = dict(ev)
        rec.setdefault("t", time.time())
        self._writer.put(rec)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every record so far is in the sinks and alerts are evaluated."""
        if self.recording and not self._closed:
            self._writer.flush(timeout)

    def record_through(self, step: int, timeout_s: float = 10.0) -> bool:
        """The Checkpointer's ``before_commit``: return once the ledger file holds (handed to
        the OS) every step record up to ``step`` -- a committed step is a recorded step
        (monitor/recovered.py). False when ``step`` was not recorded within ``timeout_s``.

        A step up to the one this attempt restored is not waited for, once what is queued is
        written: an earlier attempt trained it, and ``job_start`` wrote back what the ledger
        lacked of it, or nothing at all for a ledger without history (a new run directory
        over old checkpoints). A job that restores its last step and saves it again (a
        memory-tier restore made durable at the end) waited the whole timeout for it."""
        if not self.enabled or self._closed:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self._writer.flush(max(0.0, deadline - time.monotonic()))
            if self._acc.last_step >= step:  # processed, so written by the ledger sink
                return True
            if step <= self._restored_step:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)  # the loop records the step right after maybe_save returns

    def close(
        self, reason: str = "finished", eval_s: float = 0.0, checkpoint_block_s: float = 0.0
    ) -> None:
        """Write ``job_end``, drain the queue, fsync the ledger, close every sink.
        ``eval_s``: seconds evaluated after the last step (in the ``job_end``: no step
        record follows to carry them)."""
        if not getattr(self, "recording", False) or getattr(self, "_closed", True):
            return
        self._closed = True
        if hasattr(self, "_atexit"):
            atexit.unregister(self._atexit)
        self._close_reason = reason
        # A constructor that raised part-way (before the writer existed) leaves nothing to
        # drain: closing must then be a no-op, not an AttributeError at interpreter exit.
        writer = getattr(self, "_writer", None)
        if writer is not None:
            end = {"type": "job_end", "t": time.time(), "step": self._last_step, "reason": reason}
            if eval_s > 0:
                end["eval_s"] = float(eval_s)
            if checkpoint_block_s > 0:
                end["checkpoint_block_s"] = float(checkpoint_block_s)
            writer.put(end)
            # The writer closes the sinks: a threaded one may wait for its own (bounded) time.
            slow = [s for s in getattr(self, "_sinks", ()) if isinstance(s, ThreadedSink)]
            writer.close(60.0 + (close_wait_s(reason) if slow else 0.0))
        if hasattr(self, "_rss"):
            self._rss.close()

    @property
    def position(self) -> int:
        """The step the job's timeline is at: on rank 0 the newest step of the ledger's
        history that is still kept (after rollbacks), elsewhere this rank's last step."""
        return self._acc.last_step if self.enabled else self._last_step

    def breakdown(self, now: float | None = None) -> Breakdown:
        """Goodput so far, all attempts included (consistent after ``flush``/``close``)."""
        return self._acc.breakdown(now)

    def __enter__(self) -> GoodputMeter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, _tb: Any) -> None:
        self.close("finished" if exc_type is None else f"error: {exc_type.__name__}: {exc}")

    # -- the background thread -------------------------------------------------------------
    def _open_sinks(self) -> None:
        if self.config.per_rank:
            self._ranks.open()
        for spec in self.config.sinks:
            if isinstance(spec, str) and spec in SLOW_SINKS:
                # made in its own thread: the ledger's first records do not wait for it
                make = lambda spec=spec: make_sink(spec, **self._sink_context)  # noqa: E731
                self._sinks.append(ThreadedSink(spec, make, self.config.flush_interval_s))
                continue
            try:
                sink = make_sink(spec, **self._sink_context)
                self._sinks.append(sink)
                if isinstance(sink, JsonlSink) and self._jsonl is None:
                    self._jsonl = sink
            except Exception:
                log.exception("meter sink %r could not start; continuing without it", spec)

    def _close_sinks(self) -> None:
        self._poll_ranks(force=True)  # the other ranks' last window, while the sinks are open
        self._ranks.close()
        # The ledger first; a threaded sink's close waits (bounded) for its backlog.
        for sink in sorted(self._sinks, key=lambda s: isinstance(s, ThreadedSink)):
            try:
                sink.close(self._close_reason)
            except Exception:
                log.exception("meter sink %r failed to close", getattr(sink, "name", sink))

    def _process(self, batch: list[dict[str, Any]]) -> None:
        out: list[dict[str, Any]] = []
        for rec in batch:
            if rec.get("recovered") and rec.get("type") in ("step", "checkpoint"):
                # written back at start-up, without timing: the ledger and goodput only
                self._acc.add(rec)
                out.append(rec)
                continue
            if rec.get("type") == "step":
                loss = rec.get("loss")
                if loss is not None and not isinstance(loss, float):
                    rec["loss"] = float(loss)  # the device sync happens here, not in the loop
                self._window.append((rec["step"], rec["tokens"], rec["step_s"]))
                self.live["step"] = rec["step"]
                dw = rec.get("data_wait_s") or 0.0
                self.live["data_wait_share"] = dw / rec["step_s"] if rec["step_s"] else 0.0
            self._acc.add(rec)
            out.append(rec)
            for alert in self._engine.observe(rec):
                self._acc.add(alert)  # it is a ledger record too: keep acc == the ledger
                out.append(alert)
                self.alerts.append(alert)
                self.live["last_alert"] = f"{alert['kind']}: {alert['diagnosis']}"
                warn_alert(alert, log)
        self._update_live()
        self._ranks.write(out)
        for sink in list(self._sinks):
            try:
                sink.write(out, self.live)
            except Exception:
                log.exception("meter sink %r failed; switching it off", getattr(sink, "name", sink))
                self._sinks.remove(sink)
        self._maybe_snapshot(out)

    def _maybe_snapshot(self, out: list[dict[str, Any]]) -> None:
        """After a batch reached the ledger: publish the restart snapshot at every batch
        with a checkpoint commit or job_end (the ledger was just fsync'd) and at least
        every ``snapshot_every`` records (fsync'ing the ledger first)."""
        for rec in out:
            if rec.get("type") == "job_start":
                self._attempt_next = max(self._attempt_next, int(rec.get("attempt", 0)) + 1)
            elif rec.get("type") == "checkpoint" and rec.get("ok", True):
                self._last_ok_ckpt_t = rec.get("t")
        self._since_snapshot += len(out)
        sink = self._jsonl
        if sink is None or sink not in self._sinks:
            return  # no ledger written by this meter: nothing to snapshot
        durable = any(r.get("type") in ("checkpoint", "job_end") for r in out)
        if not durable and self._since_snapshot < self.snapshot_every:
            return
        if not sink.ledger.ok:
            # Records wait for the disk or were dropped (monitor/appender.py): the
            # accumulator holds records the file does not, so no snapshot now (a restart
            # reads the ledger from the previous snapshot on, which stays right).
            return
        try:
            if not durable and not sink.ledger.sync():
                return  # the snapshot must never cover bytes a crash can lose
            state = {
                "t": time.time(),
                "attempt_next": self._attempt_next,
                "last_ok_ckpt_t": self._last_ok_ckpt_t,
                "goodput": self._acc.state_dict(),
            }
            write_snapshot(self.run_dir, sink.ledger.offset(), state)
            self._since_snapshot = 0
        except OSError as e:  # a full disk: tried again at the next one
            log.warning("ledger snapshot not written (%s); a restart reads more of the ledger", e)
        except Exception:
            log.exception("ledger snapshot failed; a restart will read the whole ledger")

    def _update_live(self) -> None:
        b = self._acc.breakdown()  # as of the newest record, not of a late batch
        self.live["goodput"] = b.goodput if b.total_s > 0 else None
        if self._window:
            wall = sum(w[2] for w in self._window)
            toks = sum(w[1] for w in self._window)
            self.live["tokens_per_s"] = toks / wall if wall > 0 else 0.0
            if self.total_steps:
                left = max(0, self.total_steps - self._window[-1][0])
                self.live["eta_s"] = left * wall / len(self._window)

    def _poll_ranks(self, force: bool = False) -> None:
        if self._poller is not None:
            out = self._poller.poll(force)
            if out:
                self._process(out)

    def _log_rank_windows(self, by_rank: dict[int, list[dict[str, Any]]]) -> list[dict]:
        """The other ranks' window means under the Databricks DataLoader names (MLflow);
        rank 0's own come from its step records, on the sink's own ``window_s``."""
        rows = rank_windows({r: recs for r, recs in by_rank.items() if r != self.rank})
        for sink in self._sinks:
            log_rows = getattr(sink, "log_rank_windows", None)
            if rows and log_rows is not None:
                log_rows(rows)
        return []

    def _tick(self) -> None:
        self._poll_ranks()
        for sink in list(self._sinks):
            tick = getattr(sink, "tick", None)
            if tick is not None:
                try:
                    tick(self.live)
                except Exception:
                    log.exception("meter sink %r failed on tick", getattr(sink, "name", sink))
