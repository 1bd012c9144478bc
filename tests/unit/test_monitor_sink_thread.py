"""A slow sink (MLflow) behind a thread of its own (monitor/sink_thread.py): the ledger never
waits for it, not at start-up (``Run`` flushes ``job_start`` before step 1) and not on a
crash (the crashed attempt's ``job_end`` is in the ledger file when the close returns, even
if the process is killed right after); once open it gets every record, in the ledger's
order; its backlog is bounded and a close that stops waiting for it says so."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from steadytrain.monitor import meter as meter_mod
from steadytrain.monitor import sink_thread
from steadytrain.monitor import sinks as sinks_mod
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter


class _SlowSink:
    """A sink that opens when the test says so (MLflow: its import and store)."""

    opened: threading.Event
    got: list

    def __init__(self, **_context) -> None:
        assert _SlowSink.opened.wait(60), "the test never let it open"
        _SlowSink.got = []

    def write(self, records, live) -> None:
        _SlowSink.got += records

    def close(self, reason: str = "finished") -> None:
        pass


@pytest.fixture
def slow_sink(monkeypatch):
    _SlowSink.opened = threading.Event()
    _SlowSink.got = []
    monkeypatch.setitem(sinks_mod.SINKS, "slow", _SlowSink)
    monkeypatch.setattr(meter_mod, "SLOW_SINKS", ("slow",))
    yield _SlowSink
    _SlowSink.opened.set()  # a thread the test left waiting ends


def _steps(m: GoodputMeter, steps) -> None:
    for s in steps:
        m.step(s, tokens=8, data_wait_s=0.0, compute_s=0.0)


def test_a_slow_sink_opening_does_not_hold_up_the_ledger_and_misses_nothing(tmp_path, slow_sink):
    """Run flushes the attempt's job_start before step 1; a sink that takes seconds to open
    (MLflow) must not hold that up (it cost a replaced rank's first step 1.5-5 s), and once
    open it gets every record it missed, in order, job_end included."""
    m = GoodputMeter(tmp_path, sinks=("jsonl", "slow"), total_steps=4)
    try:
        m.job_start()
        m.flush(timeout=20)  # returns with the sink still opening (it waits for the Event)
        assert [r["type"] for r in read_ledger(tmp_path)] == ["job_start"]
        assert not slow_sink.opened.is_set()
        _steps(m, [1])
        slow_sink.opened.set()
        _steps(m, [2, 3])
    finally:
        slow_sink.opened.set()
        m.close()
    ledger = [(r["type"], r.get("step")) for r in read_ledger(tmp_path)]
    assert [(r["type"], r.get("step")) for r in slow_sink.got] == ledger
    assert ledger[0] == ("job_start", None) and ledger[-1][0] == "job_end"
    assert [s for t, s in ledger if t == "step"] == [1, 2, 3]


def test_a_close_that_gives_up_on_a_slow_sink_says_so(tmp_path, slow_sink, monkeypatch, caplog):
    """A crash's close waits CRASH_CLOSE_WAIT_S for a sink still opening, then says so in
    the log; the ledger has the job_end either way."""
    monkeypatch.setattr(sink_thread, "CRASH_CLOSE_WAIT_S", 0.2)
    m = GoodputMeter(tmp_path, sinks=("jsonl", "slow"))
    m.job_start()
    with caplog.at_level(logging.WARNING, logger="steadytrain.monitor"):
        m.close("error: RuntimeError: injected")
    assert "'slow' still opening after 0 s: not waiting for it any longer" in caplog.text
    ends = [r for r in read_ledger(tmp_path) if r["type"] == "job_end"]
    assert [e["reason"] for e in ends] == ["error: RuntimeError: injected"]


def test_a_slow_sink_backlog_is_bounded(tmp_path, slow_sink, monkeypatch, caplog):
    """While the sink is still opening, at most MAX_BACKLOG_RECORDS wait for it; the rest
    are dropped and counted (the ledger keeps them all), and the sink gets the first ones
    in order once it opens."""
    monkeypatch.setattr(sink_thread, "MAX_BACKLOG_RECORDS", 5)
    m = GoodputMeter(tmp_path, sinks=("jsonl", "slow"))
    m.job_start()
    with caplog.at_level(logging.WARNING, logger="steadytrain.monitor"):
        for s in range(1, 21):  # a flush per step: one batch (one record) each
            _steps(m, [s])
            m.flush(timeout=20)
        slow_sink.opened.set()
        m.close()
    ledger = read_ledger(tmp_path)
    assert [r.get("step") for r in ledger if r["type"] == "step"] == list(range(1, 21))
    got = [(r["type"], r.get("step")) for r in slow_sink.got]
    # job_end too when the sink had caught up by the close (the thread's pace decides)
    assert got[:5] == [("job_start", None)] + [("step", s) for s in range(1, 5)]
    assert got[5:] in ([], [("job_end", 20)])
    assert "dropping its new records until it catches up" in caplog.text
    assert f"missed {16 + 6 - len(got)} records" in caplog.text  # steps 5-20 (and job_end)


# A real process: the meter of a crashed attempt with a slow sink that is still opening, or
# open and stuck in its first write (replaying what it missed), closes with a crash reason;
# the test SIGKILLs it as soon as close returns (no exit hook runs) and reads the ledger.
_CRASHING = textwrap.dedent(
    """
    import sys, threading, time
    from steadytrain.monitor import meter as meter_mod, sink_thread, sinks as sinks_mod

    run_dir, mode = sys.argv[1], sys.argv[2]
    never = threading.Event()

    class Stuck:
        def __init__(self, **_):
            if mode == "opening":
                never.wait()
        def write(self, records, live):
            if mode == "replaying":
                never.wait()
        def close(self, reason="finished"):
            pass

    sinks_mod.SINKS["stuck"] = Stuck
    meter_mod.SLOW_SINKS = ("stuck",)
    sink_thread.CRASH_CLOSE_WAIT_S = float(sys.argv[3])
    m = meter_mod.GoodputMeter(run_dir, sinks=("jsonl", "stuck"))
    m.job_start()
    m.flush()
    for s in (1, 2, 3):
        m.step(s, tokens=8, data_wait_s=0.0, compute_s=0.0)
    m.close("error: RuntimeError: injected crash")
    print("closed", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("mode", ["opening", "replaying"])
def test_a_crash_job_end_reaches_the_ledger_before_a_kill_with_a_slow_sink(tmp_path, mode):
    """What CI saw once (a crashed attempt without its job_end) must not come from a slow
    sink: the close of a crash returns with job_end in the ledger file, whatever the sink is
    doing, and a SIGKILL right then loses nothing."""
    script = tmp_path / "crashing.py"
    script.write_text(_CRASHING)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), mode, "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()  # blocks until close returned (or the process died)
        assert line.strip() == "closed", proc.stderr.read()[-4000:] if proc.poll() else line
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    records = read_ledger(run_dir)
    assert [r["type"] for r in records] == ["job_start", "step", "step", "step", "job_end"]
    assert records[-1]["reason"] == "error: RuntimeError: injected crash"
    assert records[-1]["step"] == 3


def test_threaded_sink_hands_rank_windows_and_ticks_in_order():
    """The sink's other calls go through the same thread: rank windows between the record
    batches they came with, and ticks while it is idle."""
    calls: list = []
    ticked = threading.Event()

    class Sink:
        def write(self, records, live):
            calls.append(("write", [r["step"] for r in records], live.get("step")))

        def log_rank_windows(self, rows):
            calls.append(("windows", [r["rank"] for r in rows]))

        def tick(self, live):
            if live.get("step") == 2:
                ticked.set()

        def close(self, reason="finished"):
            calls.append(("close", reason))

    t = sink_thread.ThreadedSink("probe", Sink, tick_s=0.01)
    t.write([{"step": 1}], {"step": 1})
    t.log_rank_windows([{"rank": 1}])
    t.write([{"step": 2}], {"step": 2})
    t.tick({"step": 2})
    deadline = time.monotonic() + 60
    while not ticked.is_set() and time.monotonic() < deadline:
        ticked.wait(0.05)
    assert ticked.is_set()
    t.close("finished")
    assert calls == [
        ("write", [1], 1),
        ("windows", [1]),
        ("write", [2], 2),
        ("close", "finished"),
    ]


def test_a_clean_close_waits_for_a_sink_still_opening_then_hands_it_everything(
    tmp_path, slow_sink, monkeypatch
) -> None:
    """Under load MLflow's open took over a minute (CLOSE_WAIT_S): a job that ends cleanly
    waits for the open (OPEN_WAIT_S), so the run's metrics reach MLflow; a crashed one
    does not."""
    monkeypatch.setattr(sink_thread, "CLOSE_WAIT_S", 0.2)
    m = GoodputMeter(tmp_path, sinks=("jsonl", "slow"), total_steps=4)
    _steps(m, [1, 2])
    threading.Timer(1.5, slow_sink.opened.set).start()  # opens after the close began
    m.close()  # clean: "finished"
    assert slow_sink.opened.is_set()
    got = [(r["type"], r.get("step")) for r in slow_sink.got]
    assert got == [(r["type"], r.get("step")) for r in read_ledger(tmp_path)]
    assert got[-1][0] == "job_end"
