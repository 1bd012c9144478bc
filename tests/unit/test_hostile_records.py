"""Reading back a run directory that holds hostile records (issue 25, rows 1, 8 and 9).

Every case writes real files into a run directory: a ledger or rank file holding one bad
line among valid ones, a FIFO or a /dev/zero symlink in place of a rank file, a 200 MB line.
Each checks that a restarting ``GoodputMeter`` starts, records and closes; that the report
(library and CLI) finishes, shows the skipped records by file and reason, and keeps its
figures within their meaning (goodput in [0, 1], buckets >= 0 summing to the wall time).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from steadytrain.monitor.goodput import BUCKETS, GoodputAccumulator
from steadytrain.monitor.hangs import read_verdicts, recover_hang_records
from steadytrain.monitor.ledger import iter_ledger, next_attempt, read_ledger
from steadytrain.monitor.meter import GoodputMeter, MeterConfig
from steadytrain.monitor.ranks import read_ranks
from steadytrain.monitor.records import MAX_DEPTH, Rejects, open_regular
from steadytrain.report.build import build_report

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / ".venv" / "bin" / "steadytrain"
T0 = 1_700_000_000.0
STEPS = 10

# Row 1 and row 8 of issue 25: one line each, every one valid JSON except the deep one.
BAD_LEDGER_LINES = {
    "unknown type, t a string": '{"type":"zzz","t":"x"}',
    "step_s a string": '{"type":"step","t":%r,"step":3,"tokens":10,"step_s":"abc"}' % (T0 + 3),
    "attempt a string": '{"type":"job_start","t":%r,"attempt":"x"}' % (T0 + 4),
    "100k-deep": "[" * 100_000 + "]" * 100_000,
    "100k-deep object": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "step 1e30": '{"type":"step","t":%r,"step":1e30,"tokens":1,"step_s":0.1}' % (T0 + 5),
    "step_s Infinity": '{"type":"step","t":%r,"step":4,"tokens":1,"step_s":Infinity}' % (T0 + 5),
    "data_wait_s -1000": '{"type":"step","t":%r,"step":4,"step_s":1,"data_wait_s":-1000}'
    % (T0 + 5),
    "tokens -1e12": '{"type":"step","t":%r,"step":4,"step_s":1,"tokens":-1e12}' % (T0 + 5),
    "t null": '{"type":"job_start","t":null,"attempt":7,"startup_s":1}',
    "startup_s NaN": '{"type":"job_start","t":%r,"attempt":7,"startup_s":NaN}' % (T0 + 5),
    "world_size 1e15": '{"type":"job_start","t":%r,"attempt":7,"world_size":1e15}' % (T0 + 5),
    "evidence a list": '{"type":"alert","t":%r,"kind":"x","evidence":[1]}' % (T0 + 5),
    "not an object": "[1, 2, 3]",
    "torn": '{"type": "step", "t": 17000',
}
BAD_RANK_LINES = {
    "step_s Infinity": '{"type":"rank_step","step":2,"attempt":0,"step_s":Infinity}',
    "data_wait_s -1000": '{"type":"rank_step","step":2,"attempt":0,"data_wait_s":-1000}',
    "step null": '{"type":"rank_step","step":null,"attempt":0,"step_s":0.1}',
    "rss NaN": '{"type":"rank_step","step":2,"attempt":0,"rss_bytes":NaN}',
    "t null start": '{"type":"rank_start","t":"now","attempt":0,"rank":1}',
    "100k-deep": "[" * 100_000 + "]" * 100_000,
}


def _valid_ledger() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [
        {
            "type": "job_start",
            "t": T0,
            "attempt": 0,
            "world_size": 2,
            "restored_step": 0,
            "startup_s": 1.0,
            "restore_s": 0.0,
            "config": {},
            "device": "cpu",
            "expected_tokens_per_s": None,
        }
    ]
    for s in range(1, STEPS + 1):
        recs.append(
            {
                "type": "step",
                "t": T0 + s,
                "step": s,
                "tokens": 100,
                "step_s": 1.0,
                "data_wait_s": 0.1,
                "compute_s": 0.8,
                "checkpoint_block_s": 0.0,
                "loss": 1.0,
            }
        )
    recs.append({"type": "job_end", "t": T0 + STEPS + 0.5, "step": STEPS, "reason": "finished"})
    return recs


def _rank_records(rank: int) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [
        {
            "type": "rank_start",
            "t": T0,
            "attempt": 0,
            "rank": rank,
            "node": "n0",
            "world_size": 2,
            "device": "cpu",
            "pid": 1,
        }
    ]
    for s in range(1, STEPS + 1):
        recs.append(
            {
                "type": "rank_step",
                "step": s,
                "attempt": 0,
                "t": T0 + s,
                "step_s": 1.0,
                "data_wait_s": 0.1,
                "compute_s": 0.8,
                "rss_bytes": 1 << 20,
                "read_p99_s": 0.001,
            }
        )
    recs.append(
        {"type": "rank_end", "t": T0 + STEPS, "attempt": 0, "step": STEPS, "reason": "finished"}
    )
    return recs


def _write(path: Path, recs: list[Any], extra: list[str] = (), at: int = 3) -> None:
    lines = [json.dumps(r) for r in recs]
    lines[at:at] = list(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def make_run(
    run: Path, ledger_extra: list[str] = (), rank_extra: list[str] = (), at: int = 3
) -> Path:
    _write(run / "ledger.jsonl", _valid_ledger(), ledger_extra, at)
    for r in (0, 1):
        _write(
            run / "ranks" / f"rank-{r:05d}.jsonl", _rank_records(r), rank_extra if r == 1 else ()
        )
    return run


def assert_sane(s: dict[str, Any]) -> None:
    """The report's figures within their meaning."""
    assert 0.0 <= s["goodput"] <= 1.0
    assert math.isfinite(s["total_s"]) and 0 <= s["total_s"] < 1e6
    for k, v in s["badput_s"].items():
        assert math.isfinite(v) and v >= 0, (k, v)
    assert s["goodput_s"] >= 0
    assert s["goodput_s"] + sum(s["badput_s"].values()) == pytest.approx(s["total_s"])
    for row in s["ranks"]:
        for k, v in row.items():
            if isinstance(v, float):
                assert math.isfinite(v) and (v >= 0 or k.endswith("growth_mib")), (k, v)


# -- row 1: resuming a meter over a hostile ledger --------------------------------------
@pytest.mark.parametrize("name", sorted(BAD_LEDGER_LINES))
def test_meter_resumes_over_a_bad_ledger_line(tmp_path: Path, name: str) -> None:
    run = make_run(tmp_path / "run", [BAD_LEDGER_LINES[name]])
    meter = GoodputMeter(run, config=MeterConfig(per_rank=False, sinks=("jsonl",)))
    assert meter.rejected.to_dict()["ledger.jsonl"]["count"] == 1
    assert meter.attempt == 1  # the one valid job_start (attempt 0) counted, the bad one not
    meter.job_start(restored_step=STEPS)
    meter.step(STEPS + 1, tokens=100, data_wait_s=0.0, compute_s=0.01)
    meter.close()
    recs = read_ledger(run)
    assert [r["attempt"] for r in recs if r["type"] == "job_start"] == [0, 1]
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"
    b = meter.breakdown()
    assert 0.0 <= b.goodput <= 1.0 and all(v >= 0 for v in b.badput_s.values())


def test_next_attempt_survives_attempt_x(tmp_path: Path) -> None:
    make_run(tmp_path, [BAD_LEDGER_LINES["attempt a string"]])
    assert next_attempt(tmp_path) == 1


def test_close_after_a_half_built_meter_is_a_no_op() -> None:
    # What atexit finds when the constructor raised before the writer existed.
    half = object.__new__(GoodputMeter)
    half.close("interpreter_exit")  # no AttributeError: _writer
    half.recording, half._closed = True, False
    half.close("interpreter_exit")
    assert half._closed


def test_restarting_train_process_exits_cleanly_over_every_bad_line(tmp_path: Path) -> None:
    """The torchrun restart of the issue: a fresh interpreter resumes the meter over a
    ledger holding every bad line, records, and exits without a traceback (none at exit)."""
    run = make_run(tmp_path / "run", list(BAD_LEDGER_LINES.values()))
    code = (
        "import sys; from steadytrain.monitor.meter import GoodputMeter, MeterConfig\n"
        "m = GoodputMeter(sys.argv[1], config=MeterConfig(per_rank=False, sinks=('jsonl',)))\n"
        "m.job_start(restored_step=10); m.step(11, tokens=1, data_wait_s=0, compute_s=0.01)\n"
        "print(m.attempt)\n"  # no close(): the atexit path runs it
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "1"
    assert "Traceback" not in p.stderr and "AttributeError" not in p.stderr
    assert read_ledger(run)[-1]["reason"] == "interpreter_exit"


# -- rows 1 and 8: the report -------------------------------------------------------------
@pytest.fixture
def unplotted(monkeypatch) -> None:
    """``build_report`` without its PNGs. The cases that use it check what the report reads,
    counts and skips, one bad line each; matplotlib drew ~1.2 s of CPU per report there and
    nothing asserted on the pictures (a plot that fails is named in ``plots_missing``, never
    fatal). Every plot over every bad line at once: test_cli_report_json_over_every_bad_line."""
    import steadytrain.report.build as build

    monkeypatch.setattr(build, "_plots", lambda data, out, drawn, missing: {})


@pytest.mark.usefixtures("unplotted")
@pytest.mark.parametrize("name", sorted(BAD_LEDGER_LINES))
def test_report_skips_and_counts_a_bad_ledger_line(tmp_path: Path, name: str) -> None:
    run = make_run(tmp_path / "run", [BAD_LEDGER_LINES[name]])
    s = build_report(run)
    assert s["rejected_records"]["ledger.jsonl"]["count"] == 1
    assert s["attempts"] == 1 and s["steps_kept"] == STEPS
    assert s["total_s"] == pytest.approx(STEPS + 1.5)  # from T0 - startup to job_end
    assert_sane(s)


def test_report_warns_once_per_bad_line(tmp_path: Path, caplog) -> None:
    """The report and the diagnosis engine inside it both read the ledger; a bad line is
    one warning, not one per reader."""
    name = sorted(BAD_LEDGER_LINES)[0]
    run = make_run(tmp_path / "run", [BAD_LEDGER_LINES[name]])
    with caplog.at_level(logging.WARNING):
        build_report(run)
    skipped = [
        r
        for r in caplog.records
        if "ledger.jsonl" in r.getMessage() and "skipped" in r.getMessage()
    ]
    assert len(skipped) == 1, [r.getMessage() for r in skipped]


def test_report_reads_each_record_file_once_and_warns_once(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    """The report and its diagnosis engine share one read of the run's records
    (diagnose.inputs.load): the ledger and the rank files are each read once, wherever a
    module imported the readers from, and a bad rank line is one warning."""
    import sys

    from steadytrain.monitor import ledger, ranks

    calls: list[str] = []

    def counting(name, real):
        def wrapper(*a, **kw):
            calls.append(name)
            return real(*a, **kw)

        return wrapper

    for name, real in (("iter_ledger", ledger.iter_ledger), ("read_ranks", ranks.read_ranks)):
        for mod in [m for k, m in sys.modules.items() if k.startswith("steadytrain")]:
            if getattr(mod, name, None) is real:
                monkeypatch.setattr(mod, name, counting(name, real))
    run = make_run(tmp_path / "run", rank_extra=[BAD_RANK_LINES[sorted(BAD_RANK_LINES)[0]]])
    with caplog.at_level(logging.WARNING):
        s = build_report(run)
    assert sorted(calls) == ["iter_ledger", "read_ranks"]
    assert s["rejected_records"]["ranks/rank-00001.jsonl"]["count"] == 1
    skipped = [r for r in caplog.records if "rank-00001.jsonl" in r.getMessage()]
    assert len(skipped) == 1, [r.getMessage() for r in skipped]


@pytest.mark.usefixtures("unplotted")
@pytest.mark.parametrize("name", sorted(BAD_RANK_LINES))
def test_report_skips_and_counts_a_bad_rank_line(tmp_path: Path, name: str) -> None:
    run = make_run(tmp_path / "run", rank_extra=[BAD_RANK_LINES[name]])
    s = build_report(run)
    assert s["rejected_records"] == {
        "ranks/rank-00001.jsonl": s["rejected_records"]["ranks/rank-00001.jsonl"]
    }
    assert s["rejected_records"]["ranks/rank-00001.jsonl"]["count"] == 1
    row = next(r for r in s["ranks"] if r["rank"] == 1)
    assert row["steps"] == STEPS and row["step_s"] == pytest.approx(STEPS * 1.0)
    assert row["data_wait_s"] == pytest.approx(STEPS * 0.1)
    assert_sane(s)


def test_overbooked_records_are_scaled_to_the_wall_time(tmp_path: Path) -> None:
    # Valid types and ranges, but a 1e8 s step inside an 11.5 s run: goodput must not be
    # 1e7 %; the report scales every figure to the wall time and says by how much.
    line = json.dumps(
        {
            "type": "step",
            "t": T0 + 10.2,
            "step": 11,
            "tokens": 1,
            "step_s": 1e8,
            "data_wait_s": 0.0,
            "compute_s": 1e8,
        }
    )
    run = make_run(tmp_path / "run", [line], at=12)
    s = build_report(run)
    assert s["overbooked_s"] > 9e7
    assert_sane(s)


def run_cli(run: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "report", str(run), *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_report_json_over_every_bad_line(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", list(BAD_LEDGER_LINES.values()), list(BAD_RANK_LINES.values()))
    p = run_cli(run, "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    rej = s["rejected_records"]
    assert rej["ledger.jsonl"]["count"] == len(BAD_LEDGER_LINES)
    assert rej["ranks/rank-00001.jsonl"]["count"] == len(BAD_RANK_LINES)
    assert any("deeper than" in k for k in rej["ledger.jsonl"]["reasons"])
    assert s["steps_kept"] == STEPS
    assert_sane(s)
    assert s["plots"] and s["plots_missing"] == {}  # every picture drawn over every bad line
    assert all(Path(png).stat().st_size > 0 for png in s["plots"].values())
    text = run_cli(run)
    assert text.returncode == 0, text.stderr
    assert f"skipped as invalid: {len(BAD_LEDGER_LINES)} record(s) of ledger.jsonl" in text.stdout
    page = Path(s["html"]).read_text()
    assert f"skipped as invalid: {len(BAD_RANK_LINES)} record(s) of ranks/rank-00001.jsonl" in page


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_cli_report_finishes_over_a_special_rank_file(tmp_path: Path, kind: str) -> None:
    run = make_run(tmp_path / "run")
    target = run / "ranks" / "rank-00001.jsonl"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    # No PNGs: the numbers and the warning are what is read (the pictures over every bad
    # line: test_cli_report_json_over_every_bad_line).
    p = run_cli(run, "--json", "--no-plots", timeout=120)  # a hang fails here, not forever
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    rej = s["rejected_records"]["ranks/rank-00001.jsonl"]
    assert rej["count"] == 1
    why = next(iter(rej["reasons"]))
    assert ("FIFO" in why) if kind == "fifo" else ("outside the run directory" in why)
    assert "rank-00001.jsonl" in p.stderr  # the warning names the file
    assert_sane(s)


def test_open_regular_refuses_a_device_even_without_a_root(tmp_path: Path) -> None:
    link = tmp_path / "ledger.jsonl"
    link.symlink_to("/dev/zero")
    rej = Rejects()
    assert open_regular(link, None, rej, "ledger.jsonl") is None
    assert "device" in next(iter(rej.to_dict()["ledger.jsonl"]["reasons"]))
    inside = tmp_path / "real.jsonl"
    inside.write_text('{"type":"job_end","t":1}\n')
    (tmp_path / "alias.jsonl").symlink_to(inside)  # a link inside the run directory is fine
    assert [r["type"] for r in iter_ledger(tmp_path / "alias.jsonl")] == ["job_end"]


def test_ledger_fifo_and_snapshot_fifo_do_not_hang_the_meter(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    os.mkfifo(run / "ledger.snapshot.json")
    code = (
        "import sys; from steadytrain.monitor.meter import GoodputMeter, MeterConfig\n"
        "m = GoodputMeter(sys.argv[1], config=MeterConfig(per_rank=False, sinks=()))\n"
        "print(m.attempt, m.snapshot_used); m.close()\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "False"]


# -- row 9: a 200 MB line --------------------------------------------------------------
def test_a_200mb_ledger_line_is_skipped_in_bounded_memory(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    ledger = run / "ledger.jsonl"
    lines = ledger.read_bytes().splitlines(keepends=True)
    with open(ledger, "wb") as f:
        f.writelines(lines[:3])
        f.write(b'{"type":"alert","t":1,"message":"')
        chunk = b"a" * (1 << 20)
        for _ in range(200):
            f.write(chunk)
        f.write(b'"}\n')
        f.writelines(lines[3:])
    code = (
        "import resource, sys\n"
        "from steadytrain.monitor.ledger import iter_ledger\n"
        "from steadytrain.monitor.records import Rejects\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "rej = Rejects(); n = sum(1 for _ in iter_ledger(sys.argv[1], rejects=rej))\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(n, rej.total, (after - before) // 1024)\n"  # KiB on Linux -> MiB
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(ledger)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    n, rejected, grew_mib = map(int, p.stdout.split())
    assert n == STEPS + 2 and rejected == 1
    assert grew_mib < 32  # the 200 MB line was never held in memory
    c = run_cli(run, "--json", timeout=300)
    assert c.returncode == 0, c.stderr
    s = json.loads(c.stdout)
    assert s["rejected_records"]["ledger.jsonl"]["reasons"] == {"line longer than 1048576 bytes": 1}
    assert_sane(s)


# -- rank snapshots, hang verdicts ----------------------------------------------------------
def test_a_rank_snapshot_with_nan_is_not_used(tmp_path: Path) -> None:
    from steadytrain.monitor.ranks import RankFile, rank_snapshot_path

    run = tmp_path / "run"
    f = RankFile(run, 1, snapshot_every=4)
    f.write(_rank_records(1))
    f.close()
    sp = rank_snapshot_path(run, 1)
    doc = json.loads(sp.read_text())
    doc["summary"]["sums"]["step_s"] = float("nan")
    doc["summary"]["series"]["width"] = 0
    sp.write_text(json.dumps(doc))
    row = read_ranks(run).rows()[0]
    assert row["steps"] == STEPS and row["step_s"] == pytest.approx(STEPS * 1.0)


def test_hostile_hang_verdicts_count_as_no_response(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    d = run / "hangs" / "attempt-0"
    d.mkdir(parents=True)
    good = {
        "rank": 0,
        "world_size": 2,
        "step": 3,
        "detect_t": T0 + 5,
        "progress_t": T0 + 3,
        "since_progress_s": 2.0,
        "deadline_s": 1.0,
        "state": "stuck",
        "node": "n0",
    }
    (d / "rank-0.json").write_text(json.dumps(good))
    (d / "rank-1.json").write_text(json.dumps({**good, "rank": 1, "detect_t": None}))
    os.mkfifo(d / "rank-2.json")
    (d / "rank-3.json").write_text("[" * 100_000)
    (d / "rank-4.json").write_text(json.dumps({**good, "rank": "x"}))
    rej = Rejects()
    assert list(read_verdicts(d, rej)) == [0]
    assert rej.total == 4
    meter = GoodputMeter(run, config=MeterConfig(per_rank=False, sinks=("jsonl",)))
    meter.job_start(restored_step=STEPS)
    assert recover_hang_records(run, meter) == 1
    meter.close()
    hang = next(r for r in read_ledger(run) if r["type"] == "hang")
    assert hang["stuck_ranks"] == [0, 1] and hang["missing_ranks"] == [1]


def test_depth_bound_is_exact_and_strings_do_not_count(tmp_path: Path) -> None:
    ok = {"type": "alert", "t": 1.0, "evidence": {"s": "[" * 500}}
    v: Any = 1
    for _ in range(MAX_DEPTH - 2):
        v = [v]
    ok["evidence"]["deep"] = v  # record {} + evidence {} + lists: exactly MAX_DEPTH
    deep = dict(ok, evidence={"deep": [v]})
    p = tmp_path / "ledger.jsonl"
    p.write_text(json.dumps(ok) + "\n" + json.dumps(deep) + "\n")
    rej = Rejects()
    assert len(list(iter_ledger(p, rejects=rej))) == 1 and rej.total == 1


def test_accumulator_fed_directly_keeps_buckets_non_negative() -> None:
    # The live meter's path (no file reader): a caller's negative or infinite value.
    acc = GoodputAccumulator()
    acc.add({"type": "job_start", "t": 100.0, "startup_s": float("nan"), "attempt": 0})
    acc.add(
        {
            "type": "step",
            "t": 101.0,
            "step": 1,
            "step_s": float("inf"),
            "data_wait_s": -1000.0,
            "compute_s": 0.5,
            "tokens": -5,
        }
    )
    acc.add({"type": "job_end", "t": 102.0, "step": 1})
    b = acc.breakdown()
    assert b.total_s == pytest.approx(2.0) and 0 <= b.goodput <= 1
    assert all(math.isfinite(v) and v >= 0 for v in b.badput_s.values())
    assert set(b.badput_s) == set(BUCKETS) and b.tokens_kept == 0


def test_plan_from_a_hostile_run_skips_what_it_cannot_read(tmp_path: Path) -> None:
    from steadytrain.planning.run_costs import measure_run

    run = make_run(tmp_path / "run", list(BAD_LEDGER_LINES.values()))
    m = measure_run(run)
    assert m.attempts == 1 and m.steps == STEPS
    assert 0.0 <= m.goodput <= 1.0 and m.total_s == pytest.approx(STEPS + 1.5)
    assert all(math.isfinite(v) and v >= 0 for v in m.badput_s.values())


def test_step_trace_reader_checks_each_step(tmp_path: Path) -> None:
    from steadytrain.monitor.records import iter_trace

    good = {
        "step": 1,
        "attempt": 0,
        "rank": 0,
        "world": 2,
        "loss": 2.5,
        "lr": 1e-3,
        "sample_ids": [0, 1],
    }
    lines = [
        json.dumps(good),
        json.dumps({"type": "records_lost", "t": 1.0}),  # a marker: passed over, not counted
        json.dumps(dict(good, step="x")),
        json.dumps(dict(good, sample_ids=["a"])),
        "[" * 100_000,
    ]
    p = tmp_path / "trace-rank0.jsonl"
    p.write_text("\n".join(lines) + "\n")
    rej = Rejects()
    assert [r["step"] for r in iter_trace(p, rejects=rej)] == [1]
    assert rej.to_dict()["trace-rank0.jsonl"]["count"] == 3
