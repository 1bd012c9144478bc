"""Records survive SIGKILL (issue 13): COMMIT waits for rank 0's ledger
(``GoodputMeter.record_through``), and what a kill still took is recovered at the next
start-up (``monitor.recovered``). The torchrun version: tests/e2e/train/test_ledger_kills.py."""

from __future__ import annotations

import threading
import time

import pytest

from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter


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
