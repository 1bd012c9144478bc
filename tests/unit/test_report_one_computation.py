"""One set of numbers (issue 26, item 4): the report's heading, its bucket table (text and
HTML), the goodput bar and ``report --json`` print one breakdown; the table lists every
bucket and sums to 100 %; the ranks table shows every rank on every node it ran on.

The run: rank 0's ledger and rank file from a real ``GoodputMeter`` over two attempts
(a restart from step 20), ranks 1 and 2 from the meter's own ``RankFile`` writer. Rank 1
is the straggler of attempt 0 on node-1 (it waits on data 0.09 s a step while rank 0 waits
for it inside the all-reduce, booked as compute) and comes back on node-2 in attempt 1.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from steadytrain.cli import main
from steadytrain.monitor.goodput import compute_goodput
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter, MeterConfig
from steadytrain.monitor.ranks import RankFile
from steadytrain.report.build import build_report
from steadytrain.testing.synthetic import Timeline, feed

FIRST, RESTORED, LAST = 30, 20, 50  # attempt 0: steps 1..30; attempt 1: 21..50
SLOW_WAIT, WAIT = 0.09, 0.002


def _ledger_attempt(run: Path, steps: range, restored: int, end_t: float | None) -> None:
    tl = Timeline()
    tl.job_start(world_size=3, restored_step=restored, startup_s=0.5)
    for step in steps:
        straggling = restored == 0  # attempt 0: rank 0 waits for rank 1 in the all-reduce
        tl.step(
            step,
            tokens=4096,
            data_wait_s=WAIT,
            compute_s=0.1 + (SLOW_WAIT - WAIT if straggling else 0.0),
            other_s=0.01,
            read_p99_s=0.001,
            cache_misses=0,
        )
    meter = GoodputMeter(run, rank=0, world_size=3, config=MeterConfig(straggler_every_s=0))
    feed(meter, tl.anchored(end_t=end_t))
    meter.close()


def _rank_file(run: Path, rank: int, attempts: list[tuple[int, str, range, float]]) -> None:
    f = RankFile(run, rank, snapshot_every=16)
    for attempt, node, steps, wait in attempts:
        recs: list[dict[str, Any]] = [
            {"type": "rank_start", "attempt": attempt, "rank": rank, "node": node,
             "world_size": 3, "t": time.time()}
        ]  # fmt: skip
        for step in steps:
            recs.append(
                {"type": "rank_step", "step": step, "attempt": attempt, "t": time.time(),
                 "step_s": 0.112 + wait, "data_wait_s": wait, "forward_s": 0.03,
                 "read_p99_s": 0.001, "cache_misses": 0, "rss_bytes": 300 << 20,
                 "shm_bytes": 0}
            )  # fmt: skip
        f.write(recs)
    f.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("STEADYTRAIN_NODE", "node-0")  # rank 0's meter names its node
    try:
        _ledger_attempt(run, range(1, FIRST + 1), 0, end_t=time.time() - 6)
        _ledger_attempt(run, range(RESTORED + 1, LAST + 1), RESTORED, end_t=None)
    finally:
        mp.undo()
    a0, a1 = range(1, FIRST + 1), range(RESTORED + 1, LAST + 1)
    _rank_file(run, 1, [(0, "node-1", a0, SLOW_WAIT), (1, "node-2", a1, WAIT)])
    _rank_file(run, 2, [(0, "node-0", a0, WAIT), (1, "node-0", a1, WAIT)])
    return run


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["report", *args]) == 0
    return capsys.readouterr().out


def _html_buckets(page: str) -> dict[str, float]:
    table = page.split('<table class="buckets">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(
        r"<tr><td>(?:<b>)?([a-z_]+)(?:</b>)?</td><td>[\d.]+ s</td><td>([\d.]+)%", table
    )
    return {k: float(v) for k, v in rows}


def _text_buckets(text: str) -> dict[str, float]:
    return {
        m[1]: float(m[2])
        for m in re.finditer(r"^  ([a-z_]+) +([\d.]+)%  \([\d.]+ s\)$", text, re.M)
    }


def test_heading_json_and_goodput_bar_are_one_number(run: Path, tmp_path: Path, capsys) -> None:
    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path), "--json"))
    # The straggler's cost is charged: the one number is not rank 0's ledger alone.
    ledger_only = compute_goodput(read_ledger(run)).goodput
    assert s["badput_s"]["straggler_wait"] == pytest.approx(FIRST * (SLOW_WAIT - WAIT))
    assert s["goodput"] < ledger_only - 0.1

    drawn = s["plotted"]["goodput"]  # what goodput.png drew
    assert drawn["goodput"] == s["goodput"]
    assert f"Goodput {s['goodput']:.1%}" in drawn["title"]
    shares = {"goodput": s["goodput"], **s["badput"]}
    assert drawn["segments"] == {k: v for k, v in shares.items() if v > 0}
    assert "straggler_wait" in drawn["segments"]

    page = Path(s["html"]).read_text()
    heading = re.search(r"<h1>Goodput <span class=\"\w+\">([\d.]+)%</span></h1>", page)
    assert heading and heading[1] == f"{100 * s['goodput']:.1f}"
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["goodput"] == s["goodput"] and saved["badput"] == s["badput"]


def test_every_bucket_listed_and_summing_to_100(run: Path, tmp_path: Path, capsys) -> None:
    # No PNGs: the buckets' numbers, text and HTML table are what is read.
    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path), "--json", "--no-plots"))
    keys = {"goodput", *s["badput"]}
    assert {"straggler_wait", "lost_to_failures", "restart_gap", "data_wait"} <= keys
    assert s["goodput_s"] + sum(s["badput_s"].values()) == pytest.approx(s["total_s"])

    html_rows = _html_buckets(Path(s["html"]).read_text())
    text_rows = _text_buckets(_cli(capsys, str(run), "--out", str(tmp_path), "--no-plots"))
    for rows in (html_rows, text_rows):
        assert keys | {"total"} == set(rows)  # every bucket, zero ones too, and the sum
        # Each share is printed to 0.1 %, so their sum is 100 within 0.05 per bucket (a fixed
        # 0.1 failed when the run's real timings rounded 5 buckets up: 100.1).
        rounding = 0.05 * (len(rows) - 1) + 1e-9
        assert sum(v for k, v in rows.items() if k != "total") == pytest.approx(100, abs=rounding)
        assert rows["total"] == pytest.approx(100, abs=0.1)
        for k in keys:  # the same figures as the JSON
            share = s["goodput"] if k == "goodput" else s["badput"][k]
            assert rows[k] == pytest.approx(100 * share, abs=0.051)


def test_every_rank_on_every_node_and_rank_1_wait_visible(
    run: Path, tmp_path: Path, capsys
) -> None:
    s = build_report(run, tmp_path)
    r1 = next(r for r in s["ranks"] if r["rank"] == 1)
    assert r1["nodes"] == ["node-1", "node-2"]
    per = {p["node"]: p for p in r1["per_node"]}
    assert (per["node-1"]["steps"], per["node-2"]["steps"]) == (FIRST, LAST - RESTORED)
    assert (per["node-1"]["first_step"], per["node-2"]["first_step"]) == (1, RESTORED + 1)
    assert per["node-1"]["attempts"] == [0] and per["node-2"]["attempts"] == [1]
    assert per["node-1"]["data_wait_s"] == pytest.approx(FIRST * SLOW_WAIT)
    assert per["node-1"]["data_wait_share"] > 0.4 > per["node-2"]["data_wait_share"]

    # HTML: one line per (rank, node); rank 1 on node-1 and on node-2 both there.
    page = Path(s["html"]).read_text()
    ranks = page.split("<h2>Ranks", 1)[1].split("</table>", 1)[0]
    lines = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>(\d+)</td><td>([\d.]+)</td>", ranks)
    got = {(int(r), n): (int(st), float(w)) for r, n, st, w in lines}
    assert set(got) == {(0, "node-0"), (1, "node-1"), (1, "node-2"), (2, "node-0")}
    assert got[1, "node-1"] == (FIRST, pytest.approx(FIRST * SLOW_WAIT, abs=0.01))
    # The heatmap names both nodes on rank 1's row.
    assert "rank 1 (node-1, node-2)" in s["plotted"]["ranks"]["rows"]

    # The job's data-bound time is not rank 0's alone: rank 1's wait shows, on its node.
    db = s["data_bound"]
    assert db["slowest"]["rank"] == 1 and db["slowest"]["node"] == "node-1"
    assert db["s"] == pytest.approx(s["badput_s"]["data_wait"] + s["badput_s"]["straggler_wait"])
    assert db["s"] > 5 * s["badput_s"]["data_wait"]
    text = _cli(capsys, str(run), "--out", str(tmp_path))
    assert re.search(r"rank 1 +node-1 +30 steps  data wait 2\.70 s \(\d+\.\d%\)", text)
    assert re.search(r"rank 1 +node-2 +30 steps", text)
    assert "most data wait: rank 1 (node-1)" in text
    # The incident names the node rank 1 straggled on (node-1), not its newest (node-2).
    [st] = s["incidents"]
    assert (st["kind"], st["ranks"], st["nodes"]) == ("dataloader", [1], ["node-1"])


def test_records_lost_time_is_a_bucket_of_its_own(tmp_path: Path, capsys) -> None:
    """Steps a failing disk dropped: their wall time is listed as ``records_lost`` (out of
    ``other``, where no record claimed it), and the table still sums to 100 %."""
    tl = Timeline(t0=1000.0)
    tl.job_start(world_size=1)
    for step in range(1, 21):
        tl.step(step, tokens=100, compute_s=0.1, other_s=0.01)
    recs = tl.records
    lost = [r for r in recs if r["type"] == "step" and 10 <= r["step"] <= 14]
    marker = {"type": "records_lost", "t": lost[-1]["t"], "first_step": 10, "last_step": 14,
              "count": 5, "types": {"step": 5}, "t0": lost[0]["t"], "t1": lost[-1]["t"],
              "file": "ledger.jsonl", "reason": "ENOSPC"}  # fmt: skip
    kept = [r for r in recs if r not in lost]
    kept.insert(kept.index(next(r for r in kept if r.get("step") == 15)), marker)
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))

    s = json.loads(_cli(capsys, str(run), "--out", str(tmp_path / "rep"), "--json"))
    assert s["badput_s"]["records_lost"] == pytest.approx(lost[-1]["t"] - lost[0]["t"])
    assert s["goodput_s"] + sum(s["badput_s"].values()) == pytest.approx(s["total_s"])
    assert "records_lost" in s["plotted"]["goodput"]["segments"]
    rows = _html_buckets(Path(s["html"]).read_text())
    assert "records_lost" in rows
    # each share is shown rounded to 0.1 %: their sum is 100 within half of that per row
    shown = [v for k, v in rows.items() if k != "total"]
    assert sum(shown) == pytest.approx(100, abs=0.05 * len(shown))
