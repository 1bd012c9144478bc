"""Issue 25, "Losing the run directory's disk loses no training": the run directory on a
real tmpfs that fills mid-run and is freed. Records wait in a bounded buffer and are written
when space returns; past the bound the oldest are dropped and one ``records_lost`` record
marks exactly their steps, which ``steadytrain report`` shows (monitor/appender.py)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import steadytrain.monitor.appender as appender_mod
from steadytrain.cli import main
from steadytrain.monitor.appender import Appender
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.report.build import build_report

pytestmark = pytest.mark.timeout(120)


def mount_tmpfs(path: str, size: str) -> None:
    """A real small file system: mounted as root, else the test is skipped (with why)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the disk-full tests use a real full disk)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {r.stderr.strip()}")


def unmount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True)
    if os.path.ismount(path):
        subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs run directory; always unmounted."""
    run = str(tmp_path / f"run-{uuid.uuid4().hex[:6]}")
    mount_tmpfs(run, "256k")
    try:
        yield run
    finally:
        unmount(run)


def fill(disk: str) -> str:
    """Fill ``disk`` to the last byte with one file; returns its path (unlink to free)."""
    path = os.path.join(disk, "filler.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == 28, e  # ENOSPC: full
    finally:
        os.close(fd)
    for size in (1024, 64, 1):  # the last partial page too
        try:
            with open(path, "ab") as f:
                while True:
                    f.write(b"\0" * size)
                    f.flush()
        except OSError:
            pass
    return path


def steps_of(path, kind: str = "step") -> list[int]:
    return [r["step"] for r in read_ledger(path) if r["type"] == kind]


def lost_of(path) -> list[dict]:
    return [r for r in read_ledger(path) if r["type"] == "records_lost"]


def drive(meter: GoodputMeter, steps: range) -> None:
    for s in steps:
        meter.step(s, tokens=8, data_wait_s=0.0, compute_s=0.01)
        meter.flush()


def test_disk_fills_mid_run_and_frees_every_record_is_written_late(small_disk) -> None:
    ledger, rank_file = os.path.join(small_disk, "ledger.jsonl"), None
    meter = GoodputMeter(small_disk, flush_interval_s=0.02, snapshot_every=5)
    meter.job_start()
    drive(meter, range(1, 6))
    assert steps_of(ledger) == [1, 2, 3, 4, 5]
    filler = fill(small_disk)
    drive(meter, range(6, 61))  # ~55 records: far more than the last partial page holds
    on_disk = steps_of(ledger)
    assert on_disk[-1] < 60, "the disk was not full: the test proves nothing"
    assert meter._jsonl is not None and meter._jsonl.ledger.pending > 0
    os.unlink(filler)  # space returns
    drive(meter, range(61, 66))
    meter.close()
    assert steps_of(ledger) == list(range(1, 66))  # every step, in order, none twice
    assert lost_of(ledger) == []
    rank_file = os.path.join(small_disk, "ranks", "rank-00000.jsonl")
    assert steps_of(rank_file, "rank_step") == list(range(1, 66))
    assert [r["type"] for r in read_ledger(ledger)][-1] == "job_end"
    # A restart reads the same history (the snapshot never covered unwritten records).
    again = GoodputMeter(small_disk)
    assert again.breakdown().steps_kept == 65
    again.close()


@pytest.fixture
def tiny_buffer(monkeypatch):
    """A bound of 10 records for every writer made in the test (the default is 8192)."""
    monkeypatch.setattr(appender_mod, "MAX_PENDING_RECORDS", 10)


def test_past_the_bound_records_lost_covers_exactly_the_dropped_steps(
    small_disk, tiny_buffer, tmp_path, capsys
) -> None:
    ledger = os.path.join(small_disk, "ledger.jsonl")
    meter = GoodputMeter(small_disk, flush_interval_s=0.02, snapshot_every=1000)
    meter.job_start()
    drive(meter, range(1, 6))
    filler = fill(small_disk)
    drive(meter, range(6, 81))
    assert meter._jsonl is not None
    assert meter._jsonl.ledger.pending <= 10  # bounded while the disk stays full
    assert meter._jsonl.ledger.dropped > 0
    os.unlink(filler)
    drive(meter, range(81, 86))
    meter.close()
    steps = steps_of(ledger)
    assert steps == sorted(set(steps))  # in order, none twice
    (lost,) = lost_of(ledger)
    missing = sorted(set(range(1, 86)) - set(steps))
    assert missing == list(range(lost["first_step"], lost["last_step"] + 1))
    assert lost["types"]["step"] == len(missing)  # (an alert may have been dropped too)
    assert lost["count"] == sum(lost["types"].values())
    assert lost["file"] == "ledger.jsonl" and lost["reason"] == "ENOSPC"
    assert lost["t0"] <= lost["t1"]
    # Where the lost records were: after the last step before the gap, before the next
    # (among the steps: an alert of the last dropped step may be the first record kept,
    # as in a CI run of b1c3fab under load: ('alert', 73) between the gap and step 74).
    types = [
        (r["type"], r.get("step"))
        for r in read_ledger(ledger)
        if r["type"] in ("step", "records_lost")
    ]
    at = types.index(("records_lost", None))
    assert types[at - 1] == ("step", lost["first_step"] - 1)
    assert types[at + 1] == ("step", lost["last_step"] + 1)
    # The report shows the span as measured, in --json and in words.
    summary = build_report(small_disk, tmp_path / "rep", plots=False)  # numbers only
    (span,) = summary["records_lost"]
    assert (span["first_step"], span["last_step"], span["count"]) == (
        lost["first_step"],
        lost["last_step"],
        lost["count"],
    )
    assert span["span_s"] is not None and span["span_s"] >= 0
    assert main(["report", small_disk, "--out", str(tmp_path / "rep2"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert (
        f"warning: {lost['count']} record(s) of ledger.jsonl were lost (ENOSPC): "
        f"steps {lost['first_step']}..{lost['last_step']}"
    ) in out
    assert (
        main(["report", small_disk, "--out", str(tmp_path / "rep3"), "--json", "--no-plots"]) == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["records_lost"][0]["count"] == lost["count"]


def test_the_buffer_never_exceeds_its_bound_while_the_disk_stays_full(small_disk) -> None:
    fill(small_disk)
    out = Appender(os.path.join(small_disk, "x.jsonl"), max_records=100, max_bytes=20_000)
    pad = "y" * 150
    for s in range(1, 3001):
        out.append([{"type": "step", "t": float(s), "step": s, "pad": pad}])
        assert out.pending <= 100  # the records_lost placeholder included
        assert out.pending_bytes <= 20_000
    assert out.dropped >= 2900
    out.close()  # the disk is still full: what waits is counted, never raised
    assert out.never_written > 0


def test_partial_writes_never_leave_a_torn_line(small_disk) -> None:
    """A write the kernel takes only half of (the last bytes of the disk) is finished
    later, so every line of the file parses."""
    path = os.path.join(small_disk, "x.jsonl")
    out = Appender(path)
    filler = fill(small_disk)
    os.truncate(filler, os.path.getsize(filler) - 3000)  # room for ~half a big record
    for s in range(1, 20):
        out.append([{"type": "step", "t": float(s), "step": s, "pad": "z" * 5000}])
    os.unlink(filler)
    out.append([{"type": "step", "t": 20.0, "step": 20}])
    out.close()
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    assert lines[-1] == b""
    assert [json.loads(x)["step"] for x in lines[:-1]] == list(range(1, 21))


# -- fuzz: any sequence of appends while the disk fills, frees and half-frees ---------------

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 20), st.integers(0, 600)),
        st.tuples(st.just("fill"), st.just(0), st.just(0)),
        st.tuples(st.just("free"), st.just(0), st.just(0)),
        st.tuples(st.just("room"), st.integers(1, 3000), st.just(0)),  # a few bytes free
    ),
    max_size=30,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=_OPS, bound=st.integers(1, 12))
def test_fuzz_every_step_is_in_the_file_or_in_a_records_lost_span(small_disk, ops, bound) -> None:
    path = os.path.join(small_disk, f"f-{uuid.uuid4().hex[:8]}.jsonl")
    filler = os.path.join(small_disk, "filler.bin")
    out = Appender(path, max_records=bound)
    step = 0
    try:
        for op, a, b in ops:
            if op == "append":
                recs = [{"type": "step", "t": float(step + i), "step": step + i + 1, "p": "x" * b}
                        for i in range(a)]  # fmt: skip
                step += a
                out.append(recs)
            elif op == "fill":
                fill(small_disk)
            elif op == "free" and os.path.exists(filler):
                os.unlink(filler)
            elif op == "room" and os.path.exists(filler):
                fill(small_disk)
                os.truncate(filler, max(0, os.path.getsize(filler) - a))
            assert out.pending <= max(bound, 2)  # the gap and a half-written line at most
        if os.path.exists(filler):
            os.unlink(filler)
        out.close()
        assert out.never_written == 0
        with open(path, "rb") as f:
            data = f.read()
        assert data == b"" or data.endswith(b"\n")
        recs = [json.loads(line) for line in data.splitlines()]  # every line parses
        kept = [r["step"] for r in recs if r["type"] == "step"]
        assert kept == sorted(set(kept))  # in order, none twice
        lost: set[int] = set()
        for r in recs:
            if r["type"] == "records_lost":
                span = set(range(r["first_step"], r["last_step"] + 1))
                assert len(span) == r["count"] == r["types"]["step"]  # the oldest, in a row
                assert not span & lost and not span & set(kept)
                lost |= span
        assert set(kept) | lost == set(range(1, step + 1))
        assert out.dropped == len(lost)
        event("records dropped" if lost else "nothing dropped")
    finally:
        for p in (path, filler):
            if os.path.exists(p):
                os.unlink(p)
