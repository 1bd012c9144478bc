"""Restores by tier and the memory tier's cost in the report (issue 28, item 3).

Real ledger files (JSON lines in a run directory, as the meter writes them) read by the real
report (``build_report``, the ``steadytrain report`` CLI's ``main``): one row per attempt that
restored a step, its tier, seconds and steps lost; an older ledger without ``tier`` reads as
durable; a bad ``restore`` or ``memory_snapshot`` line is skipped and counted like any other;
the snapshots' blocking is part of ``checkpoint_block``, never added to it again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from steadytrain.cli import main
from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.ledger import read_ledger
from steadytrain.report.build import build_report
from steadytrain.testing.synthetic import Timeline

SNAP_BLOCK = 0.01  # a memory snapshot's staging, inside the step's checkpoint_block_s
DURABLE_BLOCK = 0.2


def _write(run: Path, records: list[dict[str, Any]], extra_lines: list[str] = ()) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "ledger.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return run


def _steps(tl: Timeline, first: int, last: int, *, memory: bool = True, save_at=()) -> None:
    """Steps ``first..last``; with ``memory`` a snapshot every step (its blocking inside the
    step's ``checkpoint_block_s``, as maybe_save returns it), a durable save at ``save_at``."""
    for step in range(first, last + 1):
        durable = step in save_at
        block = (SNAP_BLOCK if memory else 0.0) + (DURABLE_BLOCK if durable else 0.0)
        tl.step(step, tokens=1024, data_wait_s=0.001, compute_s=0.1, checkpoint_block_s=block,
                saved=durable)  # fmt: skip
        if memory:
            tl.event(
                {"type": "memory_snapshot", "step": step, "ok": True, "block_s": SNAP_BLOCK,
                 "write_s": 0.02, "peer_s": 0.03, "bytes": 1000, "peer_bytes": 1000,
                 "error": None}
            )  # fmt: skip


def _restore(tl: Timeline, step: int, tier: str | None, seconds: float) -> None:
    rec: dict[str, Any] = {"type": "restore", "step": step, "restore_s": seconds, "path": ""}
    if tier is not None:
        rec.update(tier=tier, bytes_local=1000 if tier == "local-memory" else 0,
                   bytes_peer=1000 if tier == "peer-memory" else 0)  # fmt: skip
    tl.event(rec)


def _tiered_run(run: Path, memory_records: bool = True) -> Path:
    """Five attempts: fresh to 10; local memory at 10 (nothing lost) to 14; a peer's memory
    at 13 (1 lost) to 20; durable at 15 (5 lost), dead in its warm-up; durable at 15 again
    (nothing more lost: the dead attempt recorded no step past 15) to 18, finished."""
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0, startup_s=1.0)
    _steps(tl, 1, 10, memory=memory_records, save_at=(5, 15))
    for attempt, step, tier, secs, last in (
        (1, 10, "local-memory", 0.4, 14),
        (2, 13, "peer-memory", 0.9, 20),
        (3, 15, "durable", 6.0, None),
        (4, 15, "durable", 5.0, 18),
    ):
        tl.advance(3.0)
        tl.job_start(attempt=attempt, restored_step=step, startup_s=1.0, restore_s=secs)
        _restore(tl, step, tier, secs)
        if last is not None:
            _steps(tl, step + 1, last, memory=memory_records, save_at=(15,))
    tl.event({"type": "job_end", "step": 18, "reason": "finished"})
    return _write(run, tl.records)


EXPECTED = [
    {"attempt": 1, "step": 10, "tier": "local-memory", "seconds": 0.4, "steps_lost": 0},
    {"attempt": 2, "step": 13, "tier": "peer-memory", "seconds": 0.9, "steps_lost": 1},
    {"attempt": 3, "step": 15, "tier": "durable", "seconds": 6.0, "steps_lost": 5},
    {"attempt": 4, "step": 15, "tier": "durable", "seconds": 5.0, "steps_lost": 0},
]
KEYS = ("attempt", "step", "tier", "seconds", "steps_lost")


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    # No PNGs (here or in build_report below): these tests read the restores' numbers, text
    # and HTML table, which are the same without plots; matplotlib was most of their CPU.
    assert main(["report", *args, "--no-plots"]) == 0
    return capsys.readouterr().out


def test_json_has_one_row_per_restore_with_tier_seconds_and_steps_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _tiered_run(tmp_path / "run")
    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path / "out"), "--json"))
    assert [{k: r[k] for k in KEYS} for r in s["restores"]] == EXPECTED
    assert s["restores"][0]["bytes_local"] == 1000 and s["restores"][1]["bytes_peer"] == 1000
    by = s["restores_by_tier"]
    assert by["local-memory"] == {"count": 1, "seconds": 0.4, "steps_lost": 0}
    assert by["peer-memory"] == {"count": 1, "seconds": 0.9, "steps_lost": 1}
    assert by["durable"]["count"] == 2 and by["durable"]["steps_lost"] == 5
    # The rows' lost steps are the steps the ledger's timeline threw away, no more.
    assert sum(r["steps_lost"] for r in s["restores"]) == s["steps_lost"] == 6
    assert not s["rejected_records"]


def test_text_and_html_print_the_restores_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _tiered_run(tmp_path / "run")
    text = _cli(capsys, str(run), "--out", str(tmp_path / "out"))
    lines = text.splitlines()
    at = lines.index("Restores:")
    rows = [ln.split() for ln in lines[at + 2 : at + 6]]
    assert [(int(r[0]), int(r[1]), r[2], float(r[3]), int(r[4])) for r in rows] == [
        tuple(e[k] for k in KEYS) for e in EXPECTED
    ]
    assert "memory snapshots: 24 ok, 0 refused or failed" in text
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<h2>Restores</h2>" in page
    assert "<td>peer-memory</td><td>0.90 s</td><td>1</td>" in page


def test_snapshot_blocking_is_inside_checkpoint_block_not_added(tmp_path: Path) -> None:
    with_snaps = build_report(_tiered_run(tmp_path / "a"), tmp_path / "oa", plots=False)
    # The same steps (the same checkpoint_block_s) without the memory_snapshot records.
    without = compute_goodput(
        r for r in read_ledger(tmp_path / "a") if r["type"] != "memory_snapshot"
    )
    assert {k: with_snaps["badput_s"][k] for k in without.badput_s} == pytest.approx(
        without.badput_s
    )
    assert with_snaps["goodput_s"] == pytest.approx(without.goodput_s)
    snaps = with_snaps["memory_snapshots"]
    assert snaps["count"] == snaps["ok"] == 24  # steps 1-10, 11-14, 14-20, 16-18
    assert snaps["block_s"] == pytest.approx(24 * SNAP_BLOCK)
    assert snaps["bytes"] == snaps["peer_bytes"] == 24 * 1000
    block = with_snaps["badput_s"]["checkpoint_block"]
    assert snaps["in_checkpoint_block"] is True
    assert snaps["share_of_checkpoint_block"] == pytest.approx(24 * SNAP_BLOCK / block)


def test_old_ledger_without_tier_reads_as_durable(tmp_path: Path) -> None:
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0)
    _steps(tl, 1, 8, memory=False, save_at=(4,))
    tl.advance(5.0)
    tl.job_start(attempt=1, restored_step=4, restore_s=2.5)
    _restore(tl, 4, None, 2.5)  # no tier, no bytes: written before the memory tier
    _steps(tl, 5, 9, memory=False)
    tl.advance(5.0)
    tl.job_start(attempt=2, restored_step=8, restore_s=1.5)  # no restore record at all
    _steps(tl, 9, 10, memory=False)
    s = build_report(_write(tmp_path / "run", tl.records), tmp_path / "out", plots=False)
    rows = [{k: r[k] for k in KEYS} for r in s["restores"]]
    assert rows == [
        {"attempt": 1, "step": 4, "tier": "durable", "seconds": 2.5, "steps_lost": 4},
        {"attempt": 2, "step": 8, "tier": "durable", "seconds": 1.5, "steps_lost": 1},
    ]
    assert s["restores"][0]["bytes_local"] is None
    assert s["memory_snapshots"]["count"] == 0


def test_a_fresh_start_is_no_restore(tmp_path: Path) -> None:
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0)
    _steps(tl, 1, 3)
    _restore(tl, 0, "durable", 0.01)  # restore_latest found nothing: step 0
    s = build_report(_write(tmp_path / "run", tl.records), tmp_path / "out", plots=False)
    assert s["restores"] == []


def test_bad_restore_and_snapshot_lines_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0)
    _steps(tl, 1, 6, save_at=(3,))
    tl.advance(2.0)
    tl.job_start(attempt=1, restored_step=6, restore_s=0.3)
    bad = [
        {"type": "restore", "step": 6, "restore_s": 0.3, "tier": 7},  # tier not a string
        {"type": "restore", "step": 6, "restore_s": -1.0, "tier": "peer-memory"},
        {"type": "restore", "step": 6, "restore_s": 0.3, "bytes_peer": float("inf")},
        {"type": "memory_snapshot", "step": 7, "block_s": "slow"},
        {"type": "memory_snapshot", "step": -7, "block_s": 0.1},
        {"type": "memory_snapshot", "step": 7, "ok": "yes"},
    ]
    lines = [json.dumps({**r, "t": tl.t}) for r in bad] + ['{"type": "restore", "step": 6']
    _restore(tl, 6, "local-memory", 0.3)
    run = _write(tmp_path / "run", tl.records[:-1], extra_lines=lines)
    with open(run / "ledger.jsonl", "a", encoding="utf-8") as f:  # the good one after
        f.write(json.dumps(tl.records[-1]) + "\n")
    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path / "out"), "--json"))
    assert s["rejected_records"]["ledger.jsonl"]["count"] == len(lines)
    reasons = s["rejected_records"]["ledger.jsonl"]["reasons"]
    assert "restore: 'tier' not a string" in reasons
    assert "memory_snapshot: 'block_s' not a number" in reasons
    assert [(r["tier"], r["seconds"]) for r in s["restores"]] == [("local-memory", 0.3)]
    assert s["memory_snapshots"]["count"] == 6  # the six good ones of attempt 0


def test_a_refused_snapshot_counts_its_blocking_and_error(tmp_path: Path) -> None:
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0)
    _steps(tl, 1, 2, memory=False)
    error = "memory tier: needs 4096 bytes, budget 1024: raise checkpoint.memory.budget_bytes"
    tl.event({"type": "memory_snapshot", "step": 2, "ok": False, "block_s": 0.05,
              "write_s": 0.0, "peer_s": 0.0, "bytes": 0, "peer_bytes": 0, "error": error})  # fmt: skip
    s = build_report(_write(tmp_path / "run", tl.records), tmp_path / "out", plots=False)
    snaps = s["memory_snapshots"]
    assert (snaps["ok"], snaps["failed"], snaps["last_error"]) == (0, 1, error)
    assert snaps["block_s"] == pytest.approx(0.05)


def test_a_trainers_own_restore_says_its_load_is_in_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42: the HF and Lightning callbacks' restore (``TrainerSaves``: the Trainer loaded
    its checkpoint before the callback's Run opened, inside the start-up) read "durable
    0.00 s" in the Restores table. Its record now says tier ``trainer``, and every view says
    the load is in start-up, with no seconds of its own; it is no durable restore."""
    from steadytrain.integrations.hooks import TrainerSaves

    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0, startup_s=2.0)
    _steps(tl, 1, 6, memory=False, save_at=(4,))
    tl.advance(3.0)
    tl.job_start(attempt=1, restored_step=4, startup_s=5.0)  # the load is in these 5 s
    saves = TrainerSaves(4, "out/checkpoint-4")
    saves.on_event = tl.event
    assert saves.restore_latest({}) == 4
    _steps(tl, 5, 8, memory=False)
    run = _write(tmp_path / "run", tl.records)
    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path / "out"), "--json"))
    row = s["restores"][0]
    assert {k: row[k] for k in KEYS} == {
        "attempt": 1, "step": 4, "tier": "trainer", "seconds": None, "steps_lost": 2,
    }  # fmt: skip
    assert row["in_startup"] is True
    assert s["restores_by_tier"]["durable"]["count"] == 0
    assert s["restores_by_tier"]["trainer"] == {"count": 1, "seconds": 0.0, "steps_lost": 2}
    text = _cli(capsys, str(run), "--out", str(tmp_path / "out"))
    lines = text.splitlines()
    at = lines.index("Restores:")
    assert lines[at + 2].split() == ["1", "4", "trainer", "in", "start-up", "2"]
    assert "inside the startup bucket" in lines[at + 3]
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<td>trainer</td><td>in start-up</td><td>2</td>" in page


def test_what_each_restore_passed_over_is_in_the_report_fresh_starts_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that reused a run directory restores nothing (step 0), and its restore record
    says which snapshots it passed over and why; a later restart passed over a damaged copy
    on another node. Both attempts' reasons reach the text, the page and --json; a record's
    untrusted text is bounded and loses its control characters."""
    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0)
    stale = "a:/dev/shm/steadytrain-0/k/rank00000/step-000000006.snap"
    skipped = [
        {"path": stale.split(":", 1)[1], "node": "a", "step": 6,
         "reason": "written by another run (nonce 1a2b3c4d5e6f..., this run's is 9f8e...)"},
        {"path": "/dev/shm/steadytrain-0/k/rank00001/step-000000006.snap", "node": "b",
         "step": 6, "reason": "not owned by this user (owner uid 65534, this is 0)\x1b[2J"},
        "not an entry",
    ]  # fmt: skip
    tl.event({"type": "restore", "step": 0, "tier": "durable", "restore_s": 0.1,
              "skipped": skipped})  # fmt: skip
    _steps(tl, 1, 4, save_at=(2,))
    tl.advance(2.0)
    tl.job_start(attempt=1, restored_step=4, restore_s=0.3)
    damaged = [{"path": "/m/k/rank00001/step-000000004.snap", "node": "b", "step": 4,
                "reason": "payload checksum mismatch; the snapshot is damaged"}]  # fmt: skip
    tl.event({"type": "restore", "step": 3, "tier": "peer-memory", "restore_s": 0.3,
              "skipped": damaged})  # fmt: skip
    run = _write(tmp_path / "run", tl.records)
    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path / "out"), "--json"))
    got = [
        (p["attempt"], p["restored_step"], p["step"], p["node"]) for p in s["restores_passed_over"]
    ]
    assert got == [(0, 0, 6, "a"), (0, 0, 6, "b"), (1, 3, 4, "b")]
    assert "written by another run (nonce 1a2b3c4d5e6f" in s["restores_passed_over"][0]["reason"]
    assert "\x1b" not in s["restores_passed_over"][1]["reason"]
    assert s["restores_passed_over_more"] == 0
    text = _cli(capsys, str(run), "--out", str(tmp_path / "out"))
    assert "passed over at restore (not restored, and why):" in text
    assert f"attempt 0: step 6, {stale}: written by another run (nonce" in text
    assert "attempt 1: step 4, b:/m/k/rank00001/step-000000004.snap: payload checksum" in text
    page = (tmp_path / "out" / "report.html").read_text()
    assert "not owned by this user (owner uid 65534" in page


def test_passed_over_entries_are_bounded(tmp_path: Path) -> None:
    from steadytrain.report.restores import PASSED_PER_RESTORE

    tl = Timeline(t0=1_000_000.0)
    tl.job_start(attempt=0)
    many = [{"path": f"p{i}", "step": i, "reason": "r"} for i in range(PASSED_PER_RESTORE + 7)]
    tl.event({"type": "restore", "step": 0, "restore_s": 0.1, "skipped": many})
    _steps(tl, 1, 2)
    s = build_report(_write(tmp_path / "run", tl.records), tmp_path / "out", plots=False)
    assert len(s["restores_passed_over"]) == PASSED_PER_RESTORE
    assert s["restores_passed_over_more"] == 7
