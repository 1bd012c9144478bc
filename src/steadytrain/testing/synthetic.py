"""Synthetic runs: ledger records whose clock and durations are given, not measured.

What the meter, the alerts and the report conclude from a run depends only on the records
they read. Tests that check those conclusions (a data stall is diagnosed as data loading, a
slow save as checkpointing) therefore build the records here and feed them through a real
``GoodputMeter`` with ``meter.event`` -- the same path every record takes to the ledger,
the goodput accumulator, the alert engine and every sink -- instead of sleeping inside a
training loop. The verdicts then hold on a fast machine and on a loaded 2-core one alike.

    tl = Timeline()
    tl.job_start(startup_s=0.05)
    for step in range(1, 41):
        tl.step(step, tokens=256, data_wait_s=0.0004, compute_s=0.012)
    records = tl.anchored()            # shifted so that the last record is "now"
    feed(meter, records)
    meter.close()

The clock is anchored at the end (``anchored``) because ``meter.close()`` stamps its
``job_end`` with the real time: every synthetic record must come before it, or the run
would seem to end before its own steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from steadytrain.monitor.ledger import step_record

__all__ = ["Timeline", "feed"]


class Timeline:
    """Builds one run's ledger records on an explicit clock (seconds, starting at ``t0``).

    Each record's ``t`` is the moment it would be written: ``job_start`` after start-up and
    restore, a step at its end (``step_s`` = data wait + compute + checkpoint block +
    evaluation + ``other_s``), a synchronous save's ``checkpoint`` record when the save
    returns, before the step record, as the reference loop writes them.
    """

    def __init__(self, t0: float = 0.0) -> None:
        self.t = float(t0)
        self.records: list[dict[str, Any]] = []

    def job_start(
        self,
        *,
        restored_step: int = 0,
        startup_s: float = 0.0,
        restore_s: float = 0.0,
        world_size: int = 1,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        """An attempt begins; ``attempt=None`` lets ``feed`` fill in the meter's number."""
        self.t += startup_s + restore_s
        rec: dict[str, Any] = {
            "type": "job_start",
            "t": self.t,
            "world_size": world_size,
            "restored_step": restored_step,
            "startup_s": startup_s,
            "restore_s": restore_s,
            "config": {},
            "expected_tokens_per_s": None,
        }
        if attempt is not None:
            rec["attempt"] = attempt
        self.records.append(rec)
        return rec

    def step(
        self,
        step: int,
        *,
        tokens: int,
        data_wait_s: float = 0.0,
        compute_s: float = 0.0,
        checkpoint_block_s: float = 0.0,
        other_s: float = 0.0,
        eval_s: float = 0.0,
        saved: bool = False,
        loss: float | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """One finished step; ``saved``: a synchronous save that blocked for
        ``checkpoint_block_s`` and committed (its ``checkpoint`` record comes first);
        ``eval_s``: an evaluation since the previous step (the ``eval`` phase)."""
        start = self.t + eval_s
        step_s = eval_s + data_wait_s + compute_s + checkpoint_block_s + other_s
        if saved:
            self.records.append(
                {
                    "type": "checkpoint",
                    "t": start + data_wait_s + compute_s + checkpoint_block_s,
                    "step": step,
                    "block_s": checkpoint_block_s,
                    "durable_s": checkpoint_block_s,
                    "ok": True,
                    "path": f"ckpt/step-{step}",
                    "error": None,
                }
            )
        self.t = self.t + step_s
        rec: dict[str, Any] = {
            **step_record(
                self.t,
                step,
                tokens,
                step_s,
                data_wait_s,
                compute_s,
                checkpoint_block_s,
                loss,
                eval_s,
            ),
            **extra,
        }
        self.records.append(rec)
        return rec

    def event(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Any other record (an async save's commit, a restore), stamped now."""
        out = {**rec, "t": self.t}
        self.records.append(out)
        return out

    def advance(self, seconds: float) -> None:
        """Time passes with nothing recorded (a crash, rescheduling, a queue)."""
        self.t += seconds

    def anchored(self, end_t: float | None = None) -> list[dict[str, Any]]:
        """Copies of the records, shifted so that the last one is at ``end_t`` (default:
        now): a meter closed afterwards stamps its ``job_end`` after all of them."""
        if not self.records:
            return []
        end = time.time() if end_t is None else end_t
        shift = end - self.records[-1]["t"]
        return [{**r, "t": r["t"] + shift} for r in self.records]


def feed(meter: Any, records: Iterable[dict[str, Any]], *, batch: int | None = None) -> None:
    """Put ``records`` into ``meter`` (a ``GoodputMeter``) through its public ``event``,
    filling a ``job_start``'s ``attempt`` from the meter (it counts earlier attempts in the
    ledger), then wait until every sink and the alert engine have seen them.

    ``batch``: hand the sinks at most this many records at a time (a flush after each
    group), as a live run's writer does every ``flush_interval_s``; without it the writer
    may take everything in one batch, and a sink that aggregates per batch (MLflow's
    window means) would see one window for the whole run.
    """
    for i, rec in enumerate(records, 1):
        if rec.get("type") == "job_start" and "attempt" not in rec:
            rec = {**rec, "attempt": meter.attempt}
        meter.event(rec)
        if batch is not None and i % batch == 0:
            meter.flush()
    meter.flush()
