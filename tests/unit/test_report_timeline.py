"""The report's per-node timeline (``report/timeline.py``): one row per node, each
attempt on the nodes that ran it, a lost node's crash marked, each incident on its node."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadytrain.monitor.meter import GoodputMeter, MeterConfig
from steadytrain.monitor.ranks import RankFile, read_ranks
from steadytrain.report.build import build_report
from steadytrain.report.timeline import node_attempts, timeline
from steadytrain.testing.synthetic import Timeline, feed

STEPS, FAULT_FROM = 60, 30


def test_rows_place_attempts_crashes_and_incidents_on_their_nodes() -> None:
    """node-1 is lost in attempt 0 and the spare node-2 joins in attempt 1."""
    summary = {
        "attempts_detail": [
            {"attempt": 0, "start_t": 100.0, "end_t": 130.0, "reason": "crashed"},
            {"attempt": 1, "start_t": 140.0, "end_t": 170.0, "restored_step": 8},
        ],
        "crashes": [{"attempt": 0, "t": 130.0, "step": 10, "reason": "killed"}],
        "ranks": [
            {"rank": 0, "node": "node-0", "nodes": ["node-0"]},
            {"rank": 1, "node": "node-2", "nodes": ["node-1", "node-2"]},
        ],
        "incidents": [
            {"t": 120.0, "step": 7, "kind": "straggler", "diagnosis": "storage",
             "node": "node-1", "rank": 1},
            {"t": 150.0, "step": 12, "kind": "loss_spike", "diagnosis": "data", "rank": 0},
            {"t": 160.0, "step": 15, "kind": "shared_slowdown", "diagnosis": "compute"},
        ],
    }  # fmt: skip
    present = {"node-0": {0, 1}, "node-1": {0}, "node-2": {1}}
    rows = {r["node"]: r for r in timeline(summary, present)}

    assert list(rows) == ["node-0", "node-1", "node-2"]
    assert rows["node-1"]["ranks"] == [1] and rows["node-2"]["ranks"] == [1]
    assert [a["attempt"] for a in rows["node-0"]["attempts"]] == [0, 1]
    assert [a["attempt"] for a in rows["node-1"]["attempts"]] == [0]
    assert [(a["attempt"], a["start"]) for a in rows["node-2"]["attempts"]] == [(1, 40.0)]
    # The crash is on the nodes of attempt 0; only node-1 never came back.
    assert [(c["step"], c["node_lost"]) for c in rows["node-1"]["crashes"]] == [(10, True)]
    assert [(c["step"], c["node_lost"]) for c in rows["node-0"]["crashes"]] == [(10, False)]
    assert rows["node-2"]["crashes"] == []
    # #1 on node-1 only; #2 (rank 0, no node) on rank 0's node; #3 on every node, marked.
    assert [(i["index"], i["everywhere"]) for i in rows["node-1"]["incidents"]] == [
        (1, False),
        (3, True),
    ]
    assert [i["index"] for i in rows["node-0"]["incidents"]] == [2, 3]
    assert [i["index"] for i in rows["node-2"]["incidents"]] == [3]
    assert rows["node-1"]["incidents"][0]["t"] == 20.0  # seconds since the first attempt


def test_without_rank_files_one_row_holds_everything() -> None:
    summary = {
        "attempts_detail": [{"attempt": 0, "start_t": 5.0, "end_t": 9.0}],
        "incidents": [{"t": 6.0, "step": 3, "kind": "straggler", "node": "node-x"}],
    }
    [row] = timeline(summary)
    assert row["node"] is None and [a["end"] for a in row["attempts"]] == [4.0]
    assert [(i["index"], i["everywhere"]) for i in row["incidents"]] == [(1, True)]


def _make_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 on node-a (a real GoodputMeter), rank 1 on node-b slow on data from
    FAULT_FROM: the report's post-hoc straggler analysis names node-b."""
    monkeypatch.setenv("STEADYTRAIN_NODE", "node-a")
    tl = Timeline()
    tl.job_start(world_size=2)
    for step in range(1, STEPS + 1):
        slow = step >= FAULT_FROM  # rank 0 waits for rank 1 in the all-reduce
        tl.step(step, tokens=4096, data_wait_s=0.002, compute_s=0.19 if slow else 0.1,
                forward_s=0.03, read_p99_s=0.001, cache_misses=0)  # fmt: skip
    records = tl.anchored()
    meter = GoodputMeter(run_dir, rank=0, world_size=2, config=MeterConfig(straggler_every_s=0))
    feed(meter, records)
    meter.close()
    t0 = records[0]["t"]
    recs = [{"type": "rank_start", "attempt": 0, "rank": 1, "node": "node-b", "world_size": 2,
             "t": t0}]  # fmt: skip
    for step in range(1, STEPS + 1):
        slow = step >= FAULT_FROM
        recs.append(
            {"type": "rank_step", "step": step, "attempt": 0, "t": t0 + 0.1 * step,
             "step_s": 0.192 if slow else 0.102, "data_wait_s": 0.09 if slow else 0.002,
             "forward_s": 0.03, "read_p99_s": 0.001, "cache_misses": 0,
             "rss_bytes": 400 << 20, "shm_bytes": 0}
        )  # fmt: skip
    f = RankFile(run_dir, 1, snapshot_every=16)
    f.write(recs)
    f.close()


def test_report_draws_the_timeline_with_the_straggler_on_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _make_run(run, monkeypatch)
    s = build_report(run)
    [st] = [a for a in s["incidents"] if a["kind"] == "dataloader"]  # the engine's
    assert st["nodes"] == ["node-b"]
    index = s["incidents"].index(st) + 1

    rows = {r["node"]: r for r in timeline(s, node_attempts(read_ranks(run)))}
    assert list(rows) == ["node-a", "node-b"]
    assert [i["index"] for i in rows["node-b"]["incidents"] if i["kind"] == "dataloader"] == [index]
    assert not [i for i in rows["node-a"]["incidents"] if i["kind"] == "dataloader"]
    assert all(len(r["attempts"]) == 1 for r in rows.values())

    png = Path(s["plots"]["timeline"])
    assert png.name == "timeline.png" and png.stat().st_size > 1000
    page = Path(s["html"]).read_text()
    assert 'alt="timeline"' in page and "Timeline per node" in page
