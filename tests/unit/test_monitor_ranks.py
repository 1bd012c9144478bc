"""Every rank's own ledger (monitor/ranks.py): written by every rank's meter, merged by step."""

from __future__ import annotations

import json
import os

import pytest

from steadytrain.monitor.meter import GoodputMeter, MeterConfig
from steadytrain.monitor.rank_recorder import RankTail, rank_windows
from steadytrain.monitor.rank_summary import MAX_BINS, StepSeries
from steadytrain.monitor.ranks import RankFile, rank_path, read_ranks


def _run_meter(run_dir, rank, steps, *, wait=0.01, world=2, attempt=0, snapshot_every=1000):
    m = GoodputMeter(
        run_dir, rank=rank, world_size=world, snapshot_every=snapshot_every, sinks=["jsonl"]
    )
    m.job_start(attempt=attempt, restored_step=steps[0] - 1)
    for s in steps:
        m.step(s, tokens=64, data_wait_s=wait * (rank + 1), compute_s=0.1, cache_misses=rank)
    m.close()
    return m


def test_every_rank_writes_its_own_file_and_the_reader_merges_them(tmp_path, monkeypatch):
    monkeypatch.setenv("STEADYTRAIN_NODE", "node-a")
    _run_meter(tmp_path, 0, range(1, 11))
    monkeypatch.setenv("STEADYTRAIN_NODE", "node-b")
    _run_meter(tmp_path, 1, range(1, 11))
    assert rank_path(tmp_path, 1).exists()
    assert (tmp_path / "ledger.jsonl").exists()  # rank 0 still keeps the job's ledger
    view = read_ranks(tmp_path, {0: 2})
    rows = {r["rank"]: r for r in view.rows()}
    assert set(rows) == {0, 1}
    assert rows[0]["node"] == "node-a" and rows[1]["node"] == "node-b"
    assert rows[0]["steps"] == rows[1]["steps"] == 10
    assert rows[1]["data_wait_s"] == pytest.approx(10 * 0.02)
    assert rows[0]["data_wait_s"] == pytest.approx(10 * 0.01)
    assert rows[1]["cache_misses"] == 10 and rows[0]["cache_misses"] == 0
    assert rows[0]["rss_mib"] > 0
    assert view.missing == [] and view.torn_lines == 0


def test_rank_other_than_zero_writes_no_job_ledger(tmp_path):
    _run_meter(tmp_path, 3, range(1, 4), world=4)
    assert not (tmp_path / "ledger.jsonl").exists()
    kinds = [json.loads(x)["type"] for x in rank_path(tmp_path, 3).read_text().splitlines()]
    assert kinds == ["rank_start", "rank_step", "rank_step", "rank_step", "rank_end"]


def test_per_rank_off_writes_nothing_on_other_ranks(tmp_path):
    off = GoodputMeter(tmp_path, rank=1, world_size=2, config=MeterConfig(per_rank=False))
    off.job_start()
    off.step(1, tokens=1, data_wait_s=0.0, compute_s=0.1)
    off.close()
    assert not (tmp_path / "ranks").exists()


def test_a_torn_line_is_skipped_and_counted(tmp_path):
    _run_meter(tmp_path, 0, range(1, 6), world=1)
    with open(rank_path(tmp_path, 0), "ab") as f:
        f.write(b'{"type":"rank_step","step":6,"att')  # SIGKILL mid-write
    view = read_ranks(tmp_path)
    assert view.torn_lines == 1
    assert view.ranks[0].steps == 5


def test_a_missing_rank_is_reported_not_fatal(tmp_path):
    _run_meter(tmp_path, 0, range(1, 4), world=3, attempt=0)
    _run_meter(tmp_path, 1, range(1, 4), world=3, attempt=0)
    view = read_ranks(tmp_path, {0: 3})
    assert view.missing == [{"rank": 2, "attempt": 0, "reason": "no rank file"}]
    # A rank whose node did not come back for attempt 1.
    _run_meter(tmp_path, 0, range(4, 6), world=2, attempt=1)
    view = read_ranks(tmp_path, {0: 3, 1: 2})
    assert {"rank": 1, "attempt": 1, "reason": "no records for this attempt"} in view.missing


def test_clocks_that_differ_between_nodes_do_not_reorder_steps(tmp_path):
    """Rank 1's node clock is an hour ahead: its steps still line up with rank 0's."""
    for rank, skew in ((0, 0.0), (1, 3600.0)):
        rf = RankFile(tmp_path, rank)
        recs = [
            {
                "type": "rank_step",
                "step": s,
                "attempt": 0,
                "t": 1e9 + skew + s,
                "step_s": 0.1,
                "data_wait_s": 0.05 if (rank == 1 and s > 5) else 0.0,
            }
            for s in range(1, 11)
        ]
        rf.write(recs)
        rf.close()
    width, grid = read_ranks(tmp_path).aligned()
    assert width == 1
    assert sorted(grid[0]) == sorted(grid[1]) == list(range(10))
    # The slow steps of rank 1 are steps 6..10 on the common grid, whatever its clock said.
    assert [b for b, v in sorted(grid[1].items()) if v["data_wait_s"] > 0] == [5, 6, 7, 8, 9]


def test_the_reader_starts_from_the_snapshot_not_the_whole_file(tmp_path):
    _run_meter(tmp_path, 0, range(1, 51), world=1, snapshot_every=10)
    path = rank_path(tmp_path, 0)
    assert path.with_name("rank-00000.snapshot.json").exists()
    # Damage a record far before the snapshot's offset: a reader that starts at the snapshot
    # never sees it (a whole-file read would skip one torn line and count 49 steps).
    data = bytearray(path.read_bytes())
    first_step = data.index(b'{"type":"rank_step"')
    data[first_step : first_step + 5] = b"#####"
    path.write_bytes(bytes(data))
    os.utime(path)
    view = read_ranks(tmp_path)
    assert view.torn_lines == 0
    assert view.ranks[0].steps == 50


def test_series_memory_is_flat_in_the_run_length():
    series = StepSeries()
    for s in range(1, 10_001):
        series.add(s, {"step_s": 0.1, "data_wait_s": 0.01, "rss_bytes": s})
    assert len(series.bins) <= MAX_BINS
    assert sum(b["n"] for b in series.bins.values()) == 10_000
    assert sum(b["data_wait_s"] for b in series.bins.values()) == pytest.approx(100.0)
    assert max(b["rss_bytes"] for b in series.bins.values()) == 10_000


def test_tail_reads_only_new_complete_lines(tmp_path):
    _run_meter(tmp_path, 0, range(1, 4), world=1)
    tail = RankTail(tmp_path)
    assert tail.poll() == {}  # history is the report's business
    rf = RankFile(tmp_path, 0)
    rf.write([{"type": "rank_step", "step": 4, "attempt": 1, "data_wait_s": 0.2}])
    rf.close()
    with open(rank_path(tmp_path, 0), "ab") as f:
        f.write(b'{"type":"rank_step","step":5')  # not finished yet: waits
    got = tail.poll()
    assert [r["step"] for r in got[0]] == [4]
    with open(rank_path(tmp_path, 0), "ab") as f:
        f.write(b',"attempt":1,"data_wait_s":0.4}\n')
    assert [r["step"] for r in tail.poll()[0]] == [5]


def test_rank_windows_use_the_databricks_names():
    rows = rank_windows(
        {
            2: [
                {"type": "rank_step", "step": 7, "data_wait_s": 0.1, "between_next_s": 1.0},
                {"type": "rank_step", "step": 8, "data_wait_s": 0.3, "between_next_s": 1.0},
                {"type": "rank_start"},
            ]
        }
    )
    assert rows == [
        {
            "rank": 2,
            "step": 8,
            "fetch_seconds": pytest.approx(0.2),
            "fetch_seconds_variance": pytest.approx(0.01),
            "between_next_seconds": 1.0,
            "between_next_seconds_variance": 0.0,
        }
    ]
