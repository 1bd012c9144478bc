"""The meter's restart snapshot (RUN_DIR/ledger.snapshot.json): start-up reads only the
ledger records after it, and the result equals the full recompute exactly."""

from __future__ import annotations

import atexit
import json
import logging
import os

from steadytrain.monitor.goodput import GoodputAccumulator, compute_goodput
from steadytrain.monitor.ledger import ledger_path, read_ledger, snapshot_path
from steadytrain.monitor.meter import GoodputMeter


def ckpt_event(s: int, ok: bool = True) -> dict:
    return {
        "type": "checkpoint",
        "step": s,
        "block_s": 0.0,
        "durable_s": 0.01,
        "ok": ok,
        "path": f"ckpt/step-{s}",
        "error": None if ok else "disk full",
    }


def crash(m: GoodputMeter) -> None:
    """Stop the meter like a killed process after its last flush: no job_end record."""
    m.flush()
    m._closed = True
    atexit.unregister(m._atexit)
    m._writer.close()
    m._rss.close()


def run_attempt(run_dir, restored, last, every, bad=(), finish=False, flush_every=0, **kw):
    m = GoodputMeter(run_dir, memory_every=10**9, **kw)
    m.job_start(restored_step=restored, startup_s=0.01, restore_s=0.002 if restored else 0.0)
    for s in range(restored + 1, last + 1):
        m.step(s, tokens=64, data_wait_s=0.0, compute_s=1.0, loss=1.0 / s)  # capped: step_s
        if s % every == 0:
            m.event(ckpt_event(s, ok=s not in bad))
        if flush_every and s % flush_every == 0:
            m.flush()  # one background batch per flush_every steps
    if finish:
        m.close()
    else:
        crash(m)
    return m


def full(run_dir):
    return compute_goodput(read_ledger(run_dir)).to_dict()


def test_accumulator_state_roundtrips_through_json_mid_stream(tmp_path):
    run_attempt(tmp_path, 0, 130, 50)
    run_attempt(tmp_path, 100, 170, 50)
    recs = read_ledger(tmp_path)
    for cut in (1, 57, len(recs) // 2, len(recs) - 3):
        a = GoodputAccumulator()
        for r in recs[:cut]:
            a.add(r)
        b = GoodputAccumulator()
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        for r in recs[cut:]:
            b.add(r)
        assert b.breakdown().to_dict() == full(tmp_path)


def test_restart_from_snapshot_equals_full_recompute(tmp_path):
    # attempt 0: checkpoints 50..200, crash at 237 (37 steps redone)
    run_attempt(tmp_path, 0, 237, 50)
    m = GoodputMeter(tmp_path)
    assert m.snapshot_used and m.attempt == 1
    assert m.breakdown().to_dict() == full(tmp_path)
    crash(m)  # a meter that never started an attempt adds nothing
    # attempt 1: restores 200, the save at 300 fails, crash at 330
    run_attempt(tmp_path, 200, 330, 50, bad=(300,))
    # attempt 2: restores 250 (the newest good one), finishes
    run_attempt(tmp_path, 250, 420, 50, finish=True)
    # attempt 3 on a fresh meter: a rollback past the newest checkpoint (restore 350)
    run_attempt(tmp_path, 350, 380, 50)
    m = GoodputMeter(tmp_path)
    assert m.snapshot_used and m.attempt == 4
    assert 0 < m.records_replayed < len(read_ledger(tmp_path)) // 10  # attempt 3's tail only
    want = full(tmp_path)
    assert m.breakdown().to_dict() == want
    assert want["attempts"] == 4 and want["steps_lost"] == 37 + 80 + 70
    assert want["steps_kept"] == 380 and want["badput_s"]["lost_to_failures"] > 0
    crash(m)


def test_corrupt_or_stale_snapshot_falls_back_to_full_read(tmp_path, caplog):
    run_attempt(tmp_path, 0, 230, 50)
    run_attempt(tmp_path, 200, 260, 50)
    lp, sp = ledger_path(tmp_path), snapshot_path(tmp_path)
    n_all = len(read_ledger(tmp_path))
    good = sp.read_bytes()

    def check():
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="steadytrain.monitor"):
            m = GoodputMeter(tmp_path)
        assert not m.snapshot_used
        assert m.records_replayed == len(read_ledger(tmp_path))
        assert m.breakdown().to_dict() == full(tmp_path)
        assert "reading the whole ledger" in caplog.text
        crash(m)

    sp.write_bytes(good[: len(good) // 2])  # torn snapshot
    check()
    sp.write_text('{"version": 1, "ledger": {"offset": "x"}}')  # wrong shape
    check()

    # The ledger replaced by a shorter copy (new inode): the snapshot describes another file.
    sp.write_bytes(good)
    data = lp.read_bytes()
    cut = data[: data.index(b"\n", len(data) // 2) + 1]
    tmp = lp.with_suffix(".new")
    tmp.write_bytes(cut)
    os.replace(tmp, lp)
    check()
    assert len(read_ledger(tmp_path)) < n_all

    # Truncated in place (same inode), then grown back past the offset with other records.
    run_attempt(tmp_path, 200, 300, 50)  # fresh snapshot of this ledger
    good, data = sp.read_bytes(), lp.read_bytes()
    offset = json.loads(good)["ledger"]["offset"]
    assert offset == len(data)
    with open(lp, "r+b") as f:
        f.truncate(offset // 2)
    check()
    sp.write_bytes(good)
    with open(lp, "r+b") as f:  # same length and inode, different bytes before the offset
        f.seek(offset - 40)
        f.write(b" " * 30)
    check()


def test_startup_cost_does_not_grow_with_steps(tmp_path):
    replayed = {}
    for n in (1_000, 20_000):
        d = tmp_path / str(n)
        run_attempt(d, 0, n, 100)  # checkpoint commit every 100 steps
        run_attempt(d, n, n + 37, 100)  # 37 steps after the newest snapshot, then a crash
        m = GoodputMeter(d)
        assert m.snapshot_used
        recs = read_ledger(d)
        assert len(recs) > n
        assert m.breakdown().to_dict() == compute_goodput(recs).to_dict()
        # exactly the records after the last checkpoint commit: job_start + 37 steps
        assert m.records_replayed == 38
        replayed[n] = m.records_replayed
        crash(m)
    assert replayed[1_000] == replayed[20_000]


def test_snapshot_every_n_records_without_checkpoints(tmp_path):
    # batches of 300 steps; a snapshot once >= 1000 records: after steps 1200 and 2400
    run_attempt(tmp_path, 0, 2_500, 10**9, snapshot_every=1000, flush_every=300)
    m = GoodputMeter(tmp_path)
    # The background writer also drains on its own timer, so batch boundaries (and so the
    # exact snapshot points) move by a few records; without periodic snapshots all 2,501
    # records would be replayed.
    assert m.snapshot_used and 0 < m.records_replayed < 1000 + 300
    assert m.breakdown().to_dict() == full(tmp_path)
    crash(m)
