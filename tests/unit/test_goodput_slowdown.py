"""The ``slowdown`` badput bucket: productive time a background checkpoint write cost the
steps beside it, against the attempt's own baseline, or the previous attempt's while it has
none; steps with no baseline at all are counted as unmeasured (issue 13, item 2). Ledgers
built by hand with the answers worked out by hand; the ``report`` command prints the
bucket."""

from __future__ import annotations

import json

import pytest

from steadytrain.monitor.goodput import (
    BUCKETS,
    STATE_VERSION,
    GoodputAccumulator,
    compute_goodput,
)

# The report tests here read its numbers and words (text, JSON, the HTML page's text), the same
# without PNGs; matplotlib was most of each report's CPU.
NO_PLOTS = ["--no-plots"]


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


def ckpt(t, s, ok=True, durable_s=1.0):
    return {"type": "checkpoint", "t": t, "step": s, "ok": ok, "durable_s": durable_s}


class Clock:
    """Appends records at the time each would be written."""

    def __init__(self) -> None:
        self.t = 100.0
        self.records: list[dict] = [start(self.t)]
        self.saved_at: dict[int, float] = {}  # step -> when its save started

    def step(self, s: int, compute: float, cb: float = 0.0) -> None:
        self.t += compute + cb
        self.records.append(step(self.t, s, compute, cb))
        if cb:
            self.saved_at[s] = self.t - cb  # the block ends the step (the loop saves last)

    def ckpt(self, s: int, ok: bool = True, ended_into: float = 0.0) -> None:
        """The record of step ``s``'s save, delivered now (before the next step's record);
        its write ended ``ended_into`` seconds into that next step (0: before it began)."""
        durable = self.t + ended_into - self.saved_at.get(s, self.t - 1.0)
        self.records.append(ckpt(self.t, s, ok, durable))


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


def short_write_run(beside: list[float], found: float, ended_into: float) -> Clock:
    """Baseline 1.0 (steps 2-5), a save at step 6 whose write runs beside ``beside`` and
    ends ``ended_into`` seconds into the step that finds it finished (``found`` s long)."""
    c = Clock()
    for s in range(1, 6):
        c.step(s, 1.0)
    c.step(6, 1.0, cb=0.2)
    for i, compute in enumerate(beside):
        c.step(7 + i, compute)
    c.ckpt(6, ended_into=ended_into)
    c.step(7 + len(beside), found)
    c.step(8 + len(beside), 1.0)
    return c


def test_a_write_shorter_than_a_step_is_charged_pro_rata_to_the_step_it_overlapped() -> None:
    # The write ended 0.75 s into a 1.5 s step: half of that step ran beside it, so half
    # of it counts: 0.5 x 1.5 - 0.5 x 1.0. Left out, as before, the write would be free.
    b = compute_goodput(short_write_run([], 1.5, 0.75).records)
    assert b.badput_s["slowdown"] == pytest.approx(0.25)
    assert b.goodput_s == pytest.approx(5 * 1.0 + 1.0 + 1.5 + 1.0 - 0.25)
    check_sums(b)
    # Steps wholly beside it count whole, the last one its share: (1.2 + 1.3 + 0.2 x 1.5)
    # - (2 + 0.2) x 1.0.
    b = compute_goodput(short_write_run([1.2, 1.3], 1.5, 0.3).records)
    assert b.badput_s["slowdown"] == pytest.approx(2.8 - 2.2)


def test_a_record_without_durable_s_leaves_the_finding_step_out() -> None:
    # An older ledger: no durable_s, so no end time; the step that found the write
    # finished counts as neither, the steps wholly beside it still count.
    for beside, want in (([], 0.0), ([1.2, 1.3], 0.5)):
        records = short_write_run(beside, 1.5, 0.75).records
        for r in records:
            if r["type"] == "checkpoint":
                del r["durable_s"]
        assert compute_goodput(records).badput_s["slowdown"] == pytest.approx(want)


def test_state_dict_between_the_record_and_the_finding_step_continues_exactly() -> None:
    records = short_write_run([1.2], 1.5, 0.75).records
    whole = compute_goodput(records).to_dict()
    cut = next(i for i, r in enumerate(records) if r["type"] == "checkpoint") + 1
    acc = GoodputAccumulator()
    for rec in records[:cut]:
        acc.add(rec)
    sd = json.loads(json.dumps(acc.state_dict()))
    assert sd["write_end_t"] is not None  # the write ended; its last step is still to come
    resumed = GoodputAccumulator()
    resumed.load_state_dict(sd)
    for rec in records[cut:]:
        resumed.add(rec)
    assert resumed.breakdown().to_dict() == whole
    assert whole["badput_s"]["slowdown"] == pytest.approx(1.2 + 0.75 - 1.5)


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
    assert main(["report", str(run), "--out", str(tmp_path / "rep"), "--json", *NO_PLOTS]) == 0
    assert json.loads(capsys.readouterr().out)["badput_s"]["slowdown"] == pytest.approx(2.0)
    assert main(["report", str(run), "--out", str(tmp_path / "rep"), *NO_PLOTS]) == 0
    assert "slowdown" in capsys.readouterr().out


# -- a save in flight at every step: the carried baseline and the unmeasured count -----------


def saturated_attempt(c: Clock, restored: int, clean: list[float], writes: list[list[float]]):
    """Attempt 1 restores ``restored``; its first step (3.0 s: warm-up, never a baseline
    sample) is followed by ``clean`` steps outside writes, then saves back to back: each
    write's first step starts it (cb 0.2) and is the step that found the previous write
    done (so counts as neither), the others in ``writes[i]`` run wholly beside it."""
    c.t += 5.0
    c.records.append(start(c.t, attempt=1, restored=restored))
    s = restored + 1
    c.step(s, 3.0, cb=0.2 if not clean else 0.0)
    for compute in clean:
        s += 1
        c.step(s, compute)
    if clean:  # the first save starts at a clean step (which is a baseline sample too)
        s += 1
        c.step(s, clean[-1], cb=0.2)
    for i, beside in enumerate(writes):
        opened = s
        for compute in beside:
            s += 1
            c.step(s, compute)
        c.ckpt(opened)
        s += 1
        c.step(s, 1.2, cb=0.2 if i < len(writes) - 1 else 0.0)  # found it done: partial


def clean_attempt_then_sync_save() -> Clock:
    """Attempt 0: steps 1-5 at 1.0 s (baseline 1.0 from steps 2-5), a synchronous save of
    step 5 (its record before its step: no write), then the process dies."""
    c = Clock()
    for s in range(1, 5):
        c.step(s, 1.0)
    c.ckpt(5)
    c.step(5, 1.0, cb=0.5)
    return c


def test_an_attempt_with_a_save_always_in_flight_uses_the_previous_baseline() -> None:
    c = clean_attempt_then_sync_save()
    saturated_attempt(c, 5, clean=[], writes=[[1.4, 1.4], [1.6, 1.6]])
    b = compute_goodput(c.records)
    # Attempt 1 has no step outside a write (its first is warm-up, the rest are beside a
    # write or found one done), so attempt 0's 1.0 s is the baseline:
    # (1.4 + 1.4 - 2 x 1.0) + (1.6 + 1.6 - 2 x 1.0).
    assert b.badput_s["slowdown"] == pytest.approx(0.8 + 1.2)
    assert b.slowdown_unmeasured_steps == 0
    attempt1 = 3.0 + 2.8 + 1.2 + 3.2 + 1.2
    assert b.goodput_s == pytest.approx(5 * 1.0 + attempt1 - 2.0)
    check_sums(b)


def test_a_job_with_a_save_always_in_flight_says_its_slowdown_is_unmeasured() -> None:
    # From the first step on: step 1 starts a save, and each later save starts at the step
    # that found the previous one done; the last write is still in flight at the end.
    c = Clock()
    c.step(1, 1.0, cb=0.2)
    c.step(2, 1.5)
    c.step(3, 1.5)
    c.ckpt(1)
    c.step(4, 1.5, cb=0.2)
    c.step(5, 1.5)
    c.step(6, 1.5)
    c.ckpt(4)
    c.step(7, 1.5, cb=0.2)
    c.step(8, 1.5)
    b = compute_goodput(c.records)
    assert b.badput_s["slowdown"] == 0.0  # no baseline: nothing could be charged ...
    assert b.slowdown_unmeasured_steps == 5  # ... and the ledger says so: steps 2, 3, 5, 6, 8
    assert b.to_dict()["slowdown_unmeasured_steps"] == 5
    check_sums(b)
    # A later attempt with clean steps of its own measures again; the count stays.
    c.t += 5.0
    c.records.append(start(c.t, attempt=1, restored=4))
    for s in range(5, 9):
        c.step(s, 1.0)
    c.step(9, 1.0, cb=0.2)
    c.step(10, 1.3)
    c.ckpt(9)
    b = compute_goodput(c.records)
    assert b.slowdown_unmeasured_steps == 5
    assert b.badput_s["slowdown"] == pytest.approx(0.3)


def test_the_attempts_own_baseline_replaces_the_carried_one() -> None:
    c = clean_attempt_then_sync_save()  # baseline 1.0
    # Attempt 1 runs on a slower machine: steps at 2.0 s outside writes, 2.5 s beside one.
    saturated_attempt(c, 5, clean=[2.0, 2.0], writes=[[2.5, 2.5]])
    b = compute_goodput(c.records)
    # Its own baseline (2.0): 5.0 - 2 x 2.0 = 1.0; the carried one would give 3.0.
    assert b.badput_s["slowdown"] == pytest.approx(1.0)
    assert b.slowdown_unmeasured_steps == 0
    check_sums(b)


def cut_points(records: list[dict]) -> tuple[int, int]:
    """Indexes just after attempt 0's last record and after attempt 1's first write step."""
    second = next(i for i, r in enumerate(records) if r["type"] == "job_start" and i > 0)
    return second, second + 3


def test_state_dict_keeps_the_carried_baseline() -> None:
    c = clean_attempt_then_sync_save()
    saturated_attempt(c, 5, clean=[], writes=[[1.4, 1.4], [1.6, 1.6]])
    whole = compute_goodput(c.records).to_dict()
    assert whole["badput_s"]["slowdown"] == pytest.approx(2.0)
    for cut in cut_points(c.records):
        acc = GoodputAccumulator()
        for rec in c.records[: cut + 1]:  # attempt 1 begun: its baseline is the carried one
            acc.add(rec)
        sd = json.loads(json.dumps(acc.state_dict()))
        assert sd["version"] == STATE_VERSION == 3
        assert sd["baseline"] == [] and sd["carried_baseline"] == [1.0] * 4
        resumed = GoodputAccumulator()
        resumed.load_state_dict(sd)
        for rec in c.records[cut + 1 :]:
            resumed.add(rec)
        assert resumed.breakdown().to_dict() == whole


def as_version_2(sd: dict) -> dict:
    """A state as the previous release wrote it: no carried baseline, no unmeasured count."""
    old = {k: v for k, v in sd.items() if k not in ("carried_baseline", "unmeasured")}
    return {**old, "version": 2}


def test_a_version_2_state_still_loads() -> None:
    c = clean_attempt_then_sync_save()
    saturated_attempt(c, 5, clean=[], writes=[[1.4, 1.4], [1.6, 1.6]])
    whole = compute_goodput(c.records).to_dict()
    # Cut inside attempt 0, where a version-2 state held everything: the carry is taken from
    # its own baseline at the next job_start, so the result is exact.
    acc = GoodputAccumulator()
    for rec in c.records[:4]:
        acc.add(rec)
    resumed = GoodputAccumulator()
    resumed.load_state_dict(as_version_2(json.loads(json.dumps(acc.state_dict()))))
    for rec in c.records[4:]:
        resumed.add(rec)
    assert resumed.breakdown().to_dict() == whole
    bad = {**acc.state_dict(), "version": 1}
    with pytest.raises(ValueError, match="version 1"):
        GoodputAccumulator().load_state_dict(bad)


def test_the_meter_restarts_from_a_version_2_snapshot_on_disk(tmp_path) -> None:
    from steadytrain.monitor.ledger import ledger_path, write_snapshot
    from steadytrain.monitor.meter import GoodputMeter

    c = clean_attempt_then_sync_save()
    saturated_attempt(c, 5, clean=[], writes=[[1.4, 1.4], [1.6, 1.6]])
    lines = [json.dumps(r) + "\n" for r in c.records]
    ledger_path(tmp_path).write_text("".join(lines))
    cut = 4  # inside attempt 0: an older release's snapshot
    acc = GoodputAccumulator()
    for rec in c.records[:cut]:
        acc.add(rec)
    state = {"attempt_next": 1, "last_ok_ckpt_t": None, "goodput": as_version_2(acc.state_dict())}
    write_snapshot(tmp_path, len("".join(lines[:cut]).encode()), state)
    m = GoodputMeter(tmp_path)
    try:
        assert m.snapshot_used and m.records_replayed == len(c.records) - cut
        assert m.breakdown().to_dict() == compute_goodput(c.records).to_dict()
    finally:
        m.close()


def test_report_says_when_the_slowdown_is_unmeasured(tmp_path, capsys) -> None:
    from steadytrain.cli import main

    c = Clock()
    c.step(1, 1.0, cb=0.2)
    c.step(2, 1.5)
    c.step(3, 1.5)
    c.ckpt(1)
    c.step(4, 1.0)
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in c.records))
    assert main(["report", str(run), "--out", str(tmp_path / "rep"), "--json", *NO_PLOTS]) == 0
    assert json.loads(capsys.readouterr().out)["slowdown_unmeasured_steps"] == 2
    assert (
        json.loads((tmp_path / "rep" / "report.json").read_text())["slowdown_unmeasured_steps"] == 2
    )
    assert main(["report", str(run), "--out", str(tmp_path / "rep"), *NO_PLOTS]) == 0
    words = "slowdown unmeasured for 2 step(s): no step ran without a checkpoint write"
    assert words in capsys.readouterr().out
    assert words in (tmp_path / "rep" / "report.html").read_text()
