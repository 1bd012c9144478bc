"""The report's per-rank part on bad input: a torn rank file, a missing one, clocks an hour
apart. None of them is fatal; the straggler is still named, aligned by step.

Rank 0's ledger and rank file come from a real ``GoodputMeter`` fed synthetic records;
rank 1's file from the meter's own ``RankFile`` writer, its clock an hour ahead; rank 2 of
the world of 3 never wrote (its node never came back).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steadytrain.monitor.meter import GoodputMeter, MeterConfig
from steadytrain.monitor.ranks import RankFile, rank_path, read_ranks
from steadytrain.report.build import build_report
from steadytrain.testing.synthetic import Timeline, feed

STEPS, FAULT_FROM, HOUR = 60, 30, 3600.0


def _slow(step: int) -> bool:
    return step >= FAULT_FROM


def _make_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEADYTRAIN_NODE", "node-a")
    tl = Timeline()
    tl.job_start(world_size=3)
    for step in range(1, STEPS + 1):
        # Rank 0 waits for rank 1 inside the all-reduce: its compute grows, its data wait not.
        tl.step(
            step,
            tokens=4096,
            data_wait_s=0.002,
            compute_s=0.19 if _slow(step) else 0.1,
            forward_s=0.03,
            read_p99_s=0.001,
            cache_misses=0,
        )
    records = tl.anchored()
    meter = GoodputMeter(run_dir, rank=0, world_size=3, config=MeterConfig(straggler_every_s=0))
    feed(meter, records)
    meter.close()
    start_t = records[0]["t"] + HOUR  # rank 1's node: its clock an hour ahead
    f = RankFile(run_dir, 1, snapshot_every=16)
    recs = [
        {"type": "rank_start", "attempt": 0, "rank": 1, "node": "node-b", "world_size": 3},
    ]
    for step in range(1, STEPS + 1):
        recs.append(
            {
                "type": "rank_step",
                "step": step,
                "attempt": 0,
                "t": start_t + 0.1 * step,
                "step_s": 0.192 if _slow(step) else 0.102,
                "data_wait_s": 0.09 if _slow(step) else 0.002,
                "forward_s": 0.03,
                "read_p99_s": 0.001,
                "cache_misses": 0,
                "rss_bytes": 400 << 20,
                "shm_bytes": 0,
            }
        )
    recs[0]["t"] = start_t
    for i in range(0, len(recs), 10):
        f.write(recs[i : i + 10])
    f.close()
    with open(rank_path(run_dir, 1), "ab") as out:  # SIGKILL in the middle of a write
        out.write(b'{"type": "rank_step", "step": 61, "atte')


def test_report_names_the_straggler_despite_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _make_run(run, monkeypatch)
    s = build_report(run)

    assert [(r["rank"], r["node"], r["steps"]) for r in s["ranks"]] == [
        (0, "node-a", STEPS),
        (1, "node-b", STEPS),
    ]
    r1 = s["ranks"][1]
    assert r1["data_wait_share"] > 0.3 > s["ranks"][0]["data_wait_share"]
    assert {"read_p99_s", "cache_misses", "rss_mib", "shm_mib", "checkpoint_block_s"} <= set(r1)
    assert s["torn_lines"] == 1  # the partial last line: skipped and counted
    assert s["missing_ranks"] == [{"rank": 2, "attempt": 0, "reason": "no rank file"}]

    # The diagnosis engine's incident: one, for the whole episode, on rank 1's node.
    [st] = s["incidents"]
    assert (st["kind"], st["nodes"], st["ranks"]) == ("dataloader", ["node-b"], [1])
    assert (st["rank"], st["node"], st["diagnosis"]) == (1, "node-b", "dataloader")
    # Aligned by step, not by the hour-ahead clock: the episode starts at the fault and its
    # time is rank 0's time of that step, inside the run.
    assert (st["first_step"], st["last_step"]) == (FAULT_FROM, STEPS) and st["step"] == FAULT_FROM
    assert 0 <= st["minutes"] <= s["total_s"] / 60
    assert st["lost_s"] == pytest.approx((STEPS - FAULT_FROM + 1) * (0.09 - 0.002), rel=0.05)
    ev = st["evidence"]
    assert ev["data_wait_s_per_step"] > 10 * ev["healthy_data_wait_s_per_step"]
    for a in s["alerts"]:  # the live alerts of rank 0's own ledger: rank 0, on its node
        assert {"rank", "node", "evidence"} <= set(a)
        assert (a["rank"], a["node"]) == (0, "node-a")

    # Rank 0 booked its wait for rank 1 as compute; the report moves it to its own bucket:
    # rank 1's excess data wait per step over rank 0's, over the slow steps.
    slow_steps = STEPS - FAULT_FROM + 1
    assert s["badput_s"]["straggler_wait"] == pytest.approx(slow_steps * (0.09 - 0.002))
    assert s["goodput_s"] + sum(s["badput_s"].values()) == pytest.approx(s["total_s"])
    assert s["goodput"] == pytest.approx(s["goodput_s"] / s["total_s"])

    width, grid = read_ranks(run).aligned()
    assert width == 1 and set(grid[0]) == set(grid[1]) == set(range(STEPS))

    page = Path(s["html"]).read_text()
    assert 'alt="ranks"' in page and Path(s["plots"]["ranks"]).stat().st_size > 1000
    assert "Missing:</b> rank 2 of attempt 0" in page
    assert "per GPU" not in page  # the device is unknown here: never "per GPU" unless cuda


def test_cli_json_and_text_name_the_straggler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _make_run(run, monkeypatch)
    # No PNGs: the ranks, incidents and warnings are read (the heatmap: the tests above).
    cmd = [sys.executable, "-m", "steadytrain.cli", "report", str(run), "--no-plots"]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and s["torn_lines"] == 1
    assert s["missing_ranks"][0]["rank"] == 2
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "incident 1: dataloader on node-b (rank 1) steps 30-60" in text.stdout
    assert "missing: rank 2 of attempt 0 (no rank file)" in text.stdout
    assert "1 torn line(s)" in text.stdout


def test_no_rank_files_is_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv("STEADYTRAIN_NODE", "node-a")
    tl = Timeline()
    tl.job_start(world_size=2)
    for step in range(1, 11):
        tl.step(step, tokens=100, compute_s=0.1)
    meter = GoodputMeter(run, rank=0, world_size=2, config=MeterConfig(per_rank=False))
    feed(meter, tl.anchored())
    meter.close()
    s = build_report(run)
    assert s["ranks"] == [] and "ranks" not in s["plots"]
    assert [m["rank"] for m in s["missing_ranks"]] == [0, 1]  # config not in the records


def test_a_crash_and_its_restart_are_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv("STEADYTRAIN_NODE", "node-a")
    cfg = MeterConfig(straggler_every_s=0)
    tl = Timeline()
    tl.job_start(world_size=1)
    for step in range(1, 11):
        tl.step(step, tokens=100, compute_s=0.1)
    meter = GoodputMeter(run, rank=0, world_size=1, config=cfg)
    feed(meter, tl.anchored(end_t=time.time() - 30))
    meter.close()
    # SIGKILL before job_end: the ledger ends at step 10 (and its snapshot is gone).
    ledger = run / "ledger.jsonl"
    lines = ledger.read_text().splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "job_end"
    ledger.write_text("".join(lines[:-1]))
    for snap in run.glob("*.snapshot.json"):
        snap.unlink()
    tl = Timeline()
    tl.job_start(world_size=1, restored_step=8)
    for step in range(9, 21):
        tl.step(step, tokens=100, compute_s=0.1)
    meter = GoodputMeter(run, rank=0, world_size=1, config=cfg)
    feed(meter, tl.anchored())
    meter.close()
    s = build_report(run)
    [crash] = s["crashes"]
    assert (crash["attempt"], crash["step"], crash["reason"]) == (0, 10, "killed")
    assert s["attempts"] == 2 and "ranks" in s["plots"]  # the heatmap marks both
