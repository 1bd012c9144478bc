"""The ``slowdown`` badput bucket: productive time a background checkpoint write cost the
steps beside it, against the attempt's own baseline (issue 13, item 2). Ledgers built by
hand with the answers worked out by hand; the ``report`` command prints the bucket."""

from __future__ import annotations

import json

import pytest

from steadytrain.monitor.goodput import BUCKETS, GoodputAccumulator, compute_goodput


def start(t, attempt=0, restored=0):
    return {"type": "job_start", "t": t, "attempt": attempt, "restored_step": restored}


def step(t, s, compute, cb=0.0):
    # No data wait and no loop overhead: step_s = compute + checkpoint block.
    return {
        "type": "step",
        "t": t,
        "step": s,
        "tokens": 10,
        "step_s": compute + cb,
        "data_wait_s": 0.0,
        "compute_s": compute,
        "checkpoint_block_s": cb,
    }


def ckpt(t, s, ok=True):
    return {"type": "checkpoint", "t": t, "step": s, "ok": ok, "durable_s": 1.0}


class Clock:
    """Appends records at the time each would be written."""

    def __init__(self) -> None:
        self.t = 100.0
        self.records: list[dict] = [start(self.t)]

    def step(self, s: int, compute: float, cb: float = 0.0) -> None:
        self.t += compute + cb
        self.records.append(step(self.t, s, compute, cb))

    def ckpt(self, s: int, ok: bool = True) -> None:
        self.records.append(ckpt(self.t, s, ok))


def async_save_run(write_steps: list[float]) -> Clock:
    """Steps 1-5 at 1.0 s (baseline), an async save at step 6 whose write runs beside
    ``write_steps``, its record, then a step that found the write done (1.5 s: it overlapped
    the write partly, counted as neither) and steps at 1.0 s."""
    c = Clock()
    for s in range(1, 6):
        c.step(s, 1.0)
    c.step(6, 1.0, cb=0.2)  # staging blocked 0.2 s; the write goes on in the background
    for i, compute in enumerate(write_steps):
        c.step(7 + i, compute)
    n = 7 + len(write_steps)
    c.ckpt(6)  # delivered at the next step's maybe_save, before that step's record
    c.step(n, 1.5)
    c.step(n + 1, 1.0)
    return c


def check_sums(b) -> None:
    assert sum(b.badput_s.values()) + b.goodput_s == pytest.approx(b.total_s)


def test_slowdown_is_the_excess_over_the_attempts_baseline() -> None:
    c = async_save_run([1.2, 1.3, 1.1])
    b = compute_goodput(c.records)
    assert "slowdown" in BUCKETS
    assert b.badput_s["slowdown"] == pytest.approx(0.6)  # (1.2 + 1.3 + 1.1) - 3 x 1.0
    compute = 5 * 1.0 + 1.0 + 3.6 + 1.5 + 1.0
    assert b.goodput_s == pytest.approx(compute - 0.6)
    assert b.badput_s["checkpoint_block"] == pytest.approx(0.2)
    check_sums(b)


def test_noise_around_the_baseline_cancels_within_one_write() -> None:
    b = compute_goodput(async_save_run([0.9, 1.1, 1.0]).records)
    assert b.badput_s["slowdown"] == pytest.approx(0.0)
    check_sums(b)


def test_a_synchronous_save_opens_no_write() -> None:
    # A sync save's record comes before its step's record: nothing runs beside it, so
    # slower steps after it are no slowdown (only the save's own block is charged).
    c = Clock()
    for s in range(1, 6):
        c.step(s, 1.0)
    c.ckpt(6)
    c.step(6, 1.0, cb=2.0)
    c.step(7, 1.4)
    b = compute_goodput(c.records)
    assert b.badput_s["slowdown"] == 0.0
    assert b.badput_s["checkpoint_block"] == pytest.approx(2.0)


def test_the_baseline_is_per_attempt_and_a_crash_mid_write_is_charged_once() -> None:
    c = async_save_run([1.0])  # attempt 0: steps 1..9, checkpoint 6 committed, no slowdown
    c.step(10, 1.0, cb=0.1)  # a second save starts at step 10 ...
    c.step(11, 1.5)  # ... a step beside it is 0.5 s slower ...
    c.t += 5.0  # ... and the process dies mid-write; attempt 1 restores step 6
    c.records.append(start(c.t, attempt=1, restored=6))
    for s in range(7, 12):
        c.step(s, 2.0)  # a slower machine: its own baseline is 2.0
    b = compute_goodput(c.records)
    assert b.badput_s["slowdown"] == pytest.approx(0.5)
    # Lost: the productive time of steps 7..11 of attempt 0 without their slowdown.
    assert b.badput_s["lost_to_failures"] == pytest.approx(1.0 + 1.5 + 1.0 + 1.0 + 1.0)
    assert b.goodput_s == pytest.approx(6 * 1.0 + 5 * 2.0)
    check_sums(b)


def test_state_dict_mid_write_continues_exactly() -> None:
    records = async_save_run([1.2, 1.3, 1.1]).records
    whole = compute_goodput(records)
    cut = 9  # after step 8: the write is open, its excess so far provisional
    acc = GoodputAccumulator()
    for rec in records[:cut]:
        acc.add(rec)
    assert acc.breakdown().badput_s["slowdown"] == pytest.approx(0.5)  # 1.2 + 1.3 - 2 x 1.0
    resumed = GoodputAccumulator()
    resumed.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    for rec in records[cut:]:
        resumed.add(rec)
    assert resumed.breakdown().to_dict() == whole.to_dict()


def test_report_command_prints_the_slowdown(tmp_path, capsys) -> None:
    from steadytrain.cli import main

    run = tmp_path / "run"
    run.mkdir()
    records = async_save_run([1.5, 1.5, 1.5, 1.5]).records
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(run), "--out", str(tmp_path / "rep"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["badput_s"]["slowdown"] == pytest.approx(2.0)
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "slowdown" in capsys.readouterr().out
