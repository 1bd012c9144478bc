"""Issue 25: nothing is appended through a symlink. A ledger, rank file, trace or hang dump
replaced by a symlink to a file elsewhere (or by a FIFO) is refused by name and counted; the
file it points to is unchanged and training goes on (monitor/appender.py)."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from steadytrain.monitor.appender import Appender
from steadytrain.monitor.hangs import hang_dir
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.monitor.watchdog import HANG_EXIT_CODE, HangWatchdog, WatchdogConfig
from steadytrain.train.support import StepTrace

pytestmark = pytest.mark.timeout(60)

PRECIOUS = b'{"someone":"else"}\nlast line without its newline'


def outside(tmp_path) -> str:
    p = tmp_path / "elsewhere" / "precious.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(PRECIOUS)
    return str(p)


def run_meter(run, steps: int = 5) -> GoodputMeter:
    meter = GoodputMeter(run, flush_interval_s=0.02)
    meter.job_start()
    for s in range(1, steps + 1):
        meter.step(s, tokens=8, data_wait_s=0.0, compute_s=0.01)
    meter.close()
    return meter


def test_a_symlinked_ledger_is_never_written_through(tmp_path, caplog) -> None:
    run = tmp_path / "run"
    run.mkdir()
    target = outside(tmp_path)
    os.symlink(target, run / "ledger.jsonl")
    with caplog.at_level(logging.WARNING, logger="steadytrain.monitor"):
        meter = run_meter(run)
    with open(target, "rb") as f:
        assert f.read() == PRECIOUS  # not one byte appended (nor a torn-tail newline)
    assert os.path.islink(run / "ledger.jsonl")
    assert meter.breakdown().steps_kept == 5  # the meter went on
    said = [r.getMessage() for r in caplog.records if "ledger.jsonl" in r.getMessage()]
    assert any("symlink" in m and "remove the link" in m for m in said), said
    # Warned once, and what could not be written is counted, naming the file.
    assert sum("open failed" in m for m in said) == 1
    assert any("could not be written before close" in m for m in said)
    # The rank file (a regular file) got every step.
    steps = [r["step"] for r in read_ledger(run / "ranks" / "rank-00000.jsonl")
             if r["type"] == "rank_step"]  # fmt: skip
    assert steps == [1, 2, 3, 4, 5]


def test_a_symlinked_rank_file_and_trace_are_never_written_through(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    target = outside(tmp_path)
    os.symlink(target, run / "ranks" / "rank-00000.jsonl")
    os.symlink(target, run / "trace-rank0.jsonl")
    run_meter(run)
    with StepTrace(str(run), 0, 1, 0, 1.0, enabled=True) as trace:
        for s in range(1, 4):
            trace.write(s, 1.0, 1.0, 0.1)
    with open(target, "rb") as f:
        assert f.read() == PRECIOUS
    assert [r["step"] for r in read_ledger(run) if r["type"] == "step"] == [1, 2, 3, 4, 5]


def test_a_fifo_in_place_of_the_ledger_does_not_hang_the_run(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    os.mkfifo(run / "ledger.jsonl")
    os.mkfifo(run / "ranks" / "rank-00000.jsonl")
    meter = run_meter(run)  # a blocking open would hang here (the timeout fails the test)
    assert meter.breakdown().steps_kept == 5


def test_writing_resumes_once_the_link_is_removed(tmp_path) -> None:
    target = outside(tmp_path)
    path = tmp_path / "x.jsonl"
    os.symlink(target, path)
    out = Appender(path)
    out.append([{"type": "step", "step": s, "t": float(s)} for s in (1, 2, 3)])
    assert out.pending == 3 and not out.ok
    os.unlink(path)  # the fix the warning names
    out.append([{"type": "step", "step": 4, "t": 4.0}])
    out.close()
    assert [r["step"] for r in read_ledger(path)] == [1, 2, 3, 4]
    assert not os.path.islink(path)
    with open(target, "rb") as f:
        assert f.read() == PRECIOUS


def test_a_symlinked_hang_dump_is_not_written_through(tmp_path) -> None:
    run = tmp_path / "run"
    d = hang_dir(run, 0)
    d.mkdir(parents=True)
    target = outside(tmp_path)
    os.symlink(target, d / "rank-0.txt")
    meter = GoodputMeter(run, rank=0, world_size=1)
    meter.job_start()
    done = threading.Event()
    exited: list[int] = []
    cfg = WatchdogConfig(floor_s=0.2, poll_s=0.05, warmup_steps=1, init_s=0.2, grace_s=2)
    wd = HangWatchdog(run, 0, 1, attempt=0, meter=meter, config=cfg,
                      exit=lambda code: (exited.append(code), done.set()))  # fmt: skip
    wd.beat(1)
    assert done.wait(30), "the watchdog never fired"
    wd.close()
    meter.close()
    assert exited == [HANG_EXIT_CODE]
    with open(target, "rb") as f:
        assert f.read() == PRECIOUS
    # The verdict and the hang record were still published.
    assert json.loads((d / "rank-0.json").read_text())["rank"] == 0
    assert [r["type"] for r in read_ledger(run)].count("hang") == 1
