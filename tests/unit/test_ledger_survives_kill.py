"""Records survive SIGKILL (issue 13): COMMIT waits for rank 0's ledger
(``GoodputMeter.record_through``), and what a kill still took is recovered at the next
start-up (``monitor.recovered``), bounded: a large gap is one summary record, accounted as
its steps (issue 40, 3). The torchrun version: tests/e2e/train/test_ledger_kills.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from steadytrain.monitor import recovered
from steadytrain.monitor.goodput import GoodputAccumulator, compute_goodput
from steadytrain.monitor.ledger import read_ledger, step_record
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.monitor.recovered import recovered_steps
from steadytrain.testing.incidents.common import report


def steps_in_file(run_dir) -> list[int]:
    return [r["step"] for r in read_ledger(run_dir / "ledger.jsonl") if r["type"] == "step"]


def test_record_through_puts_queued_steps_in_the_file(tmp_path) -> None:
    # A writer that would sleep 60 s between batches: without record_through the records
    # stay queued in memory, where a SIGKILL takes them.
    meter = GoodputMeter(tmp_path, flush_interval_s=60.0)
    meter.job_start()
    meter.flush()
    for s in range(1, 6):
        meter.step(s, tokens=8, data_wait_s=0.0, compute_s=0.01)
    assert steps_in_file(tmp_path) == []
    assert meter.record_through(5, timeout_s=10.0)
    assert steps_in_file(tmp_path) == [1, 2, 3, 4, 5]  # read back while the meter is open
    meter.close()


def test_record_through_waits_for_a_step_the_loop_records_later(tmp_path) -> None:
    # An async save's writer thread reaches COMMIT while the loop is about to record the
    # save's step: the hook waits for it instead of committing an unrecorded step.
    meter = GoodputMeter(tmp_path, flush_interval_s=60.0)
    meter.job_start()
    result: list[bool] = []
    hook = threading.Thread(target=lambda: result.append(meter.record_through(2, 10.0)))
    hook.start()
    meter.step(1, tokens=8, data_wait_s=0.0, compute_s=0.01)
    time.sleep(0.05)
    assert hook.is_alive()  # step 2 is not recorded yet
    meter.step(2, tokens=8, data_wait_s=0.0, compute_s=0.01)
    hook.join(10.0)
    assert result == [True]
    assert steps_in_file(tmp_path) == [1, 2]
    assert not meter.record_through(3, timeout_s=0.05)  # never recorded: says so, in time
    meter.close()


def test_record_through_does_not_wait_for_the_step_this_attempt_restored(tmp_path) -> None:
    # A new run directory over old checkpoints: the attempt restores step 6 (no ledger
    # history, so nothing is written back) and saves it again before training any step.
    # No record of step 6 will ever come; the hook says so at once instead of timing out
    # (it returned False after its whole timeout, and the save waited it out).
    meter = GoodputMeter(tmp_path, flush_interval_s=60.0)
    meter.job_start(restored_step=6)
    assert meter.record_through(6, timeout_s=10.0)
    starts = [r for r in read_ledger(tmp_path / "ledger.jsonl") if r["type"] == "job_start"]
    assert [r["restored_step"] for r in starts] == [6]  # what was queued is in the file
    assert not meter.record_through(7, timeout_s=0.05)  # a step of its own is still awaited
    meter.close()


def test_steps_a_checkpoint_covers_are_recovered_at_the_next_start(tmp_path) -> None:
    # Attempt 0 recorded steps 1..3; a synchronous save committed step 5 (and the process
    # died before steps 4 and 5 reached the file). Attempt 1 restores step 5.
    first = GoodputMeter(tmp_path)
    first.job_start()
    for s in range(1, 4):
        first.step(s, tokens=8, data_wait_s=0.0, compute_s=0.01)
    first.flush()
    first._closed = True  # what a SIGKILL leaves: no job_end, no more records
    first._writer.close()
    second = GoodputMeter(tmp_path)
    second.job_start(restored_step=5)
    second.step(6, tokens=8, data_wait_s=0.0, compute_s=0.01)
    second.close()
    recs = read_ledger(tmp_path / "ledger.jsonl")
    order = [(r["type"], r.get("step"), r.get("recovered", False)) for r in recs]
    starts = [i for i, o in enumerate(order) if o[0] == "job_start"]
    # Steps 4 and 5 belong to attempt 0: written before attempt 1's job_start.
    assert order[starts[1] - 2 : starts[1]] == [("step", 4, True), ("step", 5, True)]
    b = compute_goodput(recs)
    assert b.steps_kept == 6 and b.tokens_kept == 6 * 8 and b.steps_lost == 0
    assert b.attempt_summaries[0]["last_step"] == 5
    # A recovered step's time is unknown: it adds no productive second.
    assert b.goodput_s < 4 * 0.011 + 1e-9
    assert sum(b.badput_s.values()) + b.goodput_s == pytest.approx(b.total_s)
    # Nothing to recover when the ledger is complete (the next start restores step 6).
    third = GoodputMeter(tmp_path)
    third.job_start(restored_step=6)
    third.close()
    assert sum(1 for r in read_ledger(tmp_path / "ledger.jsonl") if r.get("recovered")) == 2


# -- the fill is bounded (issue 40, 3) ------------------------------------------------------
def _killed_after(run_dir, steps: int) -> None:
    """Attempt 0 records steps 1..``steps`` (8 tokens each), then dies as by SIGKILL."""
    meter = GoodputMeter(run_dir)
    meter.job_start()
    for s in range(1, steps + 1):
        meter.step(s, tokens=8, data_wait_s=0.0, compute_s=0.01)
    meter.flush()
    meter._closed = True
    meter._writer.close()


@pytest.mark.timeout(120)  # one record per step took 1 min 50 s and 930 MB here
def test_a_gap_of_two_million_steps_is_one_summary_record(tmp_path) -> None:
    _killed_after(tmp_path, 3)
    gap = 2_000_000
    second = GoodputMeter(tmp_path)
    second.job_start(restored_step=3 + gap)  # a checkpoint of step 2,000,003 was restored
    second.step(4 + gap, tokens=8, data_wait_s=0.0, compute_s=0.01)
    second.close()
    recs = read_ledger(tmp_path / "ledger.jsonl")
    assert len(recs) == 8, [r["type"] for r in recs]  # O(1): not one record per step
    summary = [r for r in recs if r.get("recovered")]
    assert len(summary) == 1 and summary[0]["steps"] == gap and summary[0]["step"] == 3 + gap
    assert summary[0]["tokens"] == gap * 8 and summary[0]["step_s"] == 0.0
    b = compute_goodput(recs)
    assert b.steps_kept == b.steps_recorded == 4 + gap and b.tokens_kept == (4 + gap) * 8
    assert b.attempt_summaries[0]["steps"] == 3 + gap
    assert b.attempt_summaries[0]["last_step"] == 3 + gap
    # The report (goodput, diagnosis) reads it as those steps.
    rep = report(str(tmp_path))
    assert rep["steps_kept"] == rep["steps_recorded"] == 4 + gap
    assert rep["tokens_kept"] == (4 + gap) * 8 and rep["last_step"] == 4 + gap
    assert rep["restarts"] == 1 and [c["attempt"] for c in rep["crashes"]] == [0]
    assert [(i["kind"], i["step"]) for i in rep["incidents"]] == [("crash", 3 + gap)]


def _ledger_with_fill(run_dir, fill) -> list[dict]:
    """One run's records, the gap filled by ``fill`` (the fill of recovered.py): attempt 0
    trains steps 1..5 and a synchronous save of step 12 commits (its record before its own
    step, as a sync save's is), then SIGKILL takes steps 6..40 (a save of 40 committed);
    attempt 1 restores 40, trains 41..44; attempt 2 restores 12, inside the recovered span."""
    recs: list[dict] = [{"type": "job_start", "t": 100.0, "attempt": 0, "restored_step": 0}]
    for s in range(1, 6):
        recs.append(step_record(100.0 + s, s, 8, 1.0, 0.1, 0.8, 0.0, 2.0))
    recs.append({"type": "checkpoint", "t": 105.5, "step": 12, "ok": True, "block_s": 0.0})
    acc = GoodputAccumulator()
    for rec in recs:
        acc.add(rec)
    recs += fill(acc, 40)
    recs.append({"type": "job_start", "t": 200.0, "attempt": 1, "restored_step": 40})
    for s in range(41, 45):
        recs.append(step_record(200.0 + s - 40, s, 8, 1.0, 0.1, 0.8, 0.0, 2.0))
    recs.append({"type": "job_start", "t": 300.0, "attempt": 2, "restored_step": 12})
    recs.append(step_record(301.0, 13, 8, 1.0, 0.1, 0.8, 0.0, 2.0))
    recs.append({"type": "job_end", "t": 302.0, "step": 13, "reason": "finished"})
    run_dir.mkdir()
    with open(run_dir / "ledger.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


def test_the_summary_is_accounted_as_the_records_one_per_step(tmp_path, monkeypatch) -> None:
    summary = _ledger_with_fill(tmp_path / "summary", recovered_steps)
    assert sum(1 for r in summary if r.get("recovered")) == 1  # 35 steps > PER_STEP_LIMIT
    monkeypatch.setattr(recovered, "PER_STEP_LIMIT", 10**9)  # the fill of before: per step
    per_step = _ledger_with_fill(tmp_path / "per-step", recovered_steps)
    assert sum(1 for r in per_step if r.get("recovered")) == 35
    got, want = compute_goodput(summary).to_dict(), compute_goodput(per_step).to_dict()
    assert got == want
    assert want["steps_lost"] == 32 and want["steps_kept"] == 13  # 13..44 redone from 12
    keys = ("goodput_s", "badput_s", "steps_kept", "steps_lost", "tokens_kept", "restarts")
    a, b = report(str(tmp_path / "summary")), report(str(tmp_path / "per-step"))
    assert {k: a[k] for k in keys + ("crashes", "incidents")} == {
        k: b[k] for k in keys + ("crashes", "incidents")
    }
