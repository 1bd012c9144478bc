"""The recovery point older than two checkpoint intervals is an alert (issue 12 item 3).

A job whose saves all fail trains on with nothing to resume from. Checkpoint records carry
the interval in force (``every_steps`` or ``interval_s``); the alert engine compares the
newest commit with it. Driven by synthetic records (steps and times given, never slept),
then end to end: a real Checkpointer whose saves start failing (a full disk) feeding a real
GoodputMeter, the alert read back from the ledger.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.monitor.alerts import AlertConfig, AlertEngine
from steadytrain.monitor.ledger import ledger_path, read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs

CFG = dict(max_recovery_age_s=None, window=3, baseline=3, warmup=0)


def _step(step: int, t: float) -> dict:
    return {"type": "step", "t": t, "step": step, "tokens": 1, "step_s": 1.0, "compute_s": 1.0}


def _ckpt(step: int, t: float, ok: bool, **interval) -> dict:
    return {"type": "checkpoint", "t": t, "step": step, "ok": ok, "error": None, **interval}


def _ages(eng: AlertEngine, records: list[dict]) -> list[dict]:
    out = []
    for rec in records:
        out += [a for a in eng.observe(rec) if a["kind"] == "recovery_point_age"]
    return out


def test_older_than_two_step_intervals():
    eng = AlertEngine(AlertConfig(**CFG))
    recs = [{"type": "job_start", "t": 0.0, "restored_step": 0}]
    for s in range(1, 27):
        recs.append(_step(s, float(s)))
        if s % 5 == 0:  # step 5 commits; 10, 15, ... fail
            recs.append(_ckpt(s, float(s), ok=s == 5, every_steps=5, interval_s=None))
    alerts = _ages(eng, recs)
    assert [a["step"] for a in alerts] == [16]  # 11 steps after step 5 > 2 x 5; once
    assert "11 steps since step 5" in alerts[0]["message"]
    assert alerts[0]["diagnosis"] == "checkpointing"
    assert alerts[0]["evidence"]["every_steps"] == 5
    # A commit clears it; the next gap of two intervals alerts again.
    later = [_ckpt(26, 26.0, ok=True, every_steps=5)] + [_step(s, float(s)) for s in (36, 37)]
    assert [a["step"] for a in _ages(eng, later)] == [37]


def test_older_than_two_time_intervals():
    eng = AlertEngine(AlertConfig(**CFG))
    recs = [
        {"type": "job_start", "t": 0.0},
        _ckpt(1, 100.0, ok=True, every_steps=0, interval_s=60.0),
        _step(2, 219.0),  # 119 s: under 2 x 60 s
        _step(3, 221.0),
    ]
    alerts = _ages(eng, recs)
    assert [a["step"] for a in alerts] == [3]
    assert "more than 2 intervals of 60 s" in alerts[0]["message"]


def test_recovery_intervals_zero_turns_it_off():
    eng = AlertEngine(AlertConfig(**CFG, recovery_intervals=0))
    recs = [{"type": "job_start", "t": 0.0}, _ckpt(1, 1.0, ok=True, every_steps=1)]
    assert _ages(eng, recs + [_step(s, float(s)) for s in range(2, 40)]) == []


def test_a_restored_step_counts_as_the_recovery_point():
    eng = AlertEngine(AlertConfig(**CFG))
    recs = [
        {"type": "job_start", "t": 0.0, "restored_step": 100},
        _ckpt(105, 5.0, ok=False, every_steps=5),
    ]
    recs += [_step(s, float(s)) for s in range(101, 112)]
    assert [a["step"] for a in _ages(eng, recs)] == [111]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (we run as root in CI); skipped where mounting is not allowed."""
    try:
        with tmpfs(tmp_path / "disk", "1M") as mnt:
            yield pathlib.Path(mnt)
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))


def test_failing_saves_reach_the_ledger_as_a_recovery_point_alert(tmp_path, tiny_disk):
    meter = GoodputMeter(tmp_path / "run", alert_config=AlertConfig(**CFG))
    ckpt = Checkpointer(str(tiny_disk), every_steps=5, async_mode="sync", on_event=meter.event)
    small, big = nn.Linear(16, 16), nn.Linear(1024, 512)  # 2 MiB never fits in 1 MiB
    meter.job_start()
    for step in range(1, 17):
        with torch.no_grad():
            for p in small.parameters():
                p.fill_(step)
        block = ckpt.maybe_save(step, {"model": small if step <= 5 else big})
        meter.step(step, tokens=1000, data_wait_s=0.0, compute_s=0.01, checkpoint_block_s=block)
    ckpt.close()
    meter.close()
    recs = read_ledger(ledger_path(tmp_path / "run"))
    saves = [(r["step"], r["ok"], r["every_steps"]) for r in recs if r["type"] == "checkpoint"]
    assert saves == [(5, True, 5), (10, False, 5), (15, False, 5)]
    ages = [r for r in recs if r["type"] == "alert" and r["kind"] == "recovery_point_age"]
    assert [a["step"] for a in ages] == [16]
    failed = [r for r in recs if r["type"] == "alert" and r["kind"] == "checkpoint_failed"]
    assert len(failed) == 2 and "No space left on device" in failed[0]["message"]
