"""A compute straggler's cost leaves goodput (issue 42, section 1), and a charge capped at
rank 0's productive time says so (section 3).

The run: rank 0's ledger from a real ``GoodputMeter`` (``Timeline`` records), every rank's
file from the meter's own writer (``RankFile``). Three ranks on three nodes on one loaded
machine (the same run queue everywhere); from step ``FROM`` rank 1's own cgroup throttles
it and its forward pass runs ``RATIO`` x the others', so every step takes ``SLOW_STEP_S``
and ranks 0 and 2 wait for it inside the all-reduce, which rank 0's ledger books as
compute. The report must move that wait into ``straggler_compute`` in every figure: the
heading, the bucket table (text, HTML), the goodput bar, ``--json`` and ``plan
--from-run``.
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
from steadytrain.planning.run_costs import measure_run
from steadytrain.testing.synthetic import Timeline, feed

STEPS, FROM = 60, 20
STEP_S, SLOW_STEP_S, WAIT, FWD, RATIO = 0.1, 0.3, 0.002, 0.03, 5.0
HOST = {"host_run_queue": 7.0, "host_cpus": 2.0, "host_steal": 0.0}


def _run(
    run: Path,
    *,
    compute_s: float | None = None,
    slow_wait: float = WAIT,
    fwd_slow: tuple[int, int] = (FROM, STEPS),
) -> Path:
    """The run (module docstring); ``compute_s``: rank 0's booked compute per step (its
    ledger's productive time), by default the step less its data wait; ``slow_wait``: rank
    1's data wait while throttled (its reads run on the CPU the quota withholds too);
    ``fwd_slow``: the steps (first, last) its forward pass runs ``RATIO`` x the others'."""
    tl = Timeline()
    tl.job_start(world_size=3)
    for step in range(1, STEPS + 1):
        step_s = SLOW_STEP_S if step >= FROM else STEP_S
        work = step_s - WAIT if compute_s is None else compute_s
        tl.step(step, tokens=4096, data_wait_s=WAIT, compute_s=work,
                other_s=step_s - WAIT - work, loss=3.0)  # fmt: skip
    meter = GoodputMeter(run, rank=0, world_size=3,
                         config=MeterConfig(straggler_every_s=0, per_rank=False))  # fmt: skip
    feed(meter, tl.anchored())
    meter.close()
    for rank in range(3):
        recs: list[dict[str, Any]] = [
            {"type": "rank_start", "attempt": 0, "rank": rank, "node": f"node-{rank}",
             "world_size": 3, "device": "cpu", "t": time.time()}
        ]  # fmt: skip
        for step in range(1, STEPS + 1):
            slow = rank == 1 and step >= FROM
            fwd = rank == 1 and fwd_slow[0] <= step <= fwd_slow[1]
            recs.append(
                {"type": "rank_step", "step": step, "attempt": 0, "t": time.time(),
                 "step_s": SLOW_STEP_S if step >= FROM else STEP_S,
                 "data_wait_s": slow_wait if slow else WAIT,
                 "forward_s": FWD * (RATIO if fwd else 1.0), "read_p99_s": 0.001,
                 "cache_misses": 0, "rss_bytes": 300 << 20, "shm_bytes": 0,
                 **HOST, "host_throttled": 0.6 if slow else 0.0}
            )  # fmt: skip
        f = RankFile(run, rank, snapshot_every=25)
        f.write(recs)
        f.close()
    return run


def _report(
    capsys: pytest.CaptureFixture[str], run: Path, out: Path, *, plots: bool = False
) -> tuple[dict, str]:
    """The JSON, then the text (and the HTML page it rewrites). PNGs only when ``plots``
    (the goodput bar's segments are read from the JSON): the text, the page's tables and the
    figures are the same without them, and matplotlib was most of each report's CPU."""
    no_plots = [] if plots else ["--no-plots"]
    assert main(["report", str(run), "--out", str(out), "--json", *no_plots]) == 0
    s = json.loads(capsys.readouterr().out)
    assert main(["report", str(run), "--out", str(out), "--no-plots"]) == 0
    return s, capsys.readouterr().out


def test_a_compute_stragglers_wait_leaves_goodput_in_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run")
    s, text = _report(capsys, run, tmp_path / "rep", plots=True)
    [inc] = s["incidents"]
    assert (inc["kind"], inc["nodes"], inc["ranks"]) == ("host-contention", ["node-1"], [1])

    # What the others waited: rank 1's step less its data wait x (1 - 1/RATIO), a step.
    per_step = (SLOW_STEP_S - WAIT) * (1 - 1 / RATIO)
    slow_steps = STEPS - FROM + 1
    charged = s["badput_s"]["straggler_compute"]
    assert charged == pytest.approx(inc["lost_s"], rel=0.01)  # one number, two places
    assert per_step * (slow_steps - 5) <= charged <= per_step * slow_steps * 1.01
    assert s["badput_s"]["straggler_wait"] == 0.0  # nobody waited on data
    ledger = compute_goodput(read_ledger(run))
    assert s["goodput_s"] == pytest.approx(ledger.goodput_s - charged)
    assert s["goodput"] < ledger.goodput - 0.3  # rank 0's ledger alone: far too high

    # Text, HTML, the bar and the JSON print that one breakdown.
    line = re.search(r"^  straggler_compute +([\d.]+)%  \(([\d.]+) s\)$", text, re.M)
    assert line and float(line[2]) == pytest.approx(charged, abs=0.05)
    assert f"goodput {s['goodput']:.1%}" in text
    page = Path(s["html"]).read_text()
    assert re.search(rf"<td>straggler_compute</td><td>{charged:.1f} s</td>", page)
    assert f'Goodput <span class="poor">{s["goodput"]:.1%}</span>' in page
    assert s["plotted"]["goodput"]["segments"]["straggler_compute"] == pytest.approx(
        s["badput"]["straggler_compute"]
    )
    # plan --from-run plans from the same goodput and counts the wait as a stall.
    m = measure_run(run)
    assert m.goodput == pytest.approx(s["goodput"])
    assert m.badput["straggler"] == pytest.approx(s["badput"]["straggler_compute"])
    assert m.data_stall_frac > 0.5  # most of each slow step waited


def test_a_throttled_ranks_data_wait_and_compute_are_one_hold_up_charged_once_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The throttled rank also waits 50 ms a step in next(): it reaches the all-reduce
    after its data wait and then its slow compute, so the others wait for both. One
    incident (its data and forward episodes merged), whose cost the two straggler buckets
    hold between them: the data part in ``straggler_wait``, the rest in
    ``straggler_compute``, nothing twice."""
    slow_wait = 0.05
    s, _ = _report(capsys, _run(tmp_path / "run", slow_wait=slow_wait), tmp_path / "rep")
    [inc] = s["incidents"]
    assert (inc["kind"], inc["nodes"]) == ("host-contention", ["node-1"])
    # one message for the one fault: both waits, and the whole cost
    assert re.search(r"forward pass \d\.\dx .* and it waited 0\.050 s/step for data",
                     inc["message"]), inc["message"]  # fmt: skip
    assert inc["message"].endswith(f"cost {inc['lost_s']:.1f} s of job time")
    bad = s["badput_s"]
    slow_steps = STEPS - FROM + 1
    assert bad["straggler_wait"] == pytest.approx((slow_wait - WAIT) * slow_steps)
    assert bad["straggler_wait"] + bad["straggler_compute"] == pytest.approx(
        inc["lost_s"], rel=0.02
    )


def test_a_throttled_ranks_forward_pass_is_charged_where_only_its_data_wait_made_an_episode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The matrix's CPU-quota run: the quota's bursts land now in next() and now in the
    forward pass, so the data wait is slow for the episode (from step 20) and the forward
    pass for two windows only (steps 21-30), short of an episode of its own. The incident
    is the data one; what the others waited for the forward pass in those two windows is
    charged too (``straggler_compute``) and is in its cost and its message."""
    slow_wait = 0.05
    run = _run(tmp_path / "run", slow_wait=slow_wait, fwd_slow=(21, 30))
    s, _ = _report(capsys, run, tmp_path / "rep")
    [inc] = s["incidents"]
    assert (inc["kind"], inc["nodes"]) == ("host-contention", ["node-1"])
    assert "forward_ratio" not in inc["evidence"]  # the data episode's incident
    assert "its forward pass slow too in 2 windows" in inc["message"], inc["message"]
    bad = s["badput_s"]
    slow_steps = STEPS - FROM + 1
    assert bad["straggler_wait"] == pytest.approx((slow_wait - WAIT) * slow_steps)
    # the others' wait for the forward pass in the 10 slow steps: step less data wait
    # x (1 - 1/RATIO)
    per_step = (SLOW_STEP_S - slow_wait) * (1 - 1 / RATIO)
    assert bad["straggler_compute"] == pytest.approx(per_step * 10, rel=0.02)
    assert bad["straggler_wait"] + bad["straggler_compute"] == pytest.approx(
        inc["lost_s"], rel=0.02
    )


def test_a_capped_charge_says_it_was_capped_and_by_how_much(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 booked only 10 ms a step as compute (its ledger's productive time): the
    others' wait is more than that, so the charge stops at it and goodput reads 0.0 % --
    with a line saying so, in text, HTML and JSON."""
    run = _run(tmp_path / "run", compute_s=0.01)
    s, text = _report(capsys, run, tmp_path / "rep")
    assert s["goodput"] == 0.0
    c = s["capped"]["straggler_compute"]
    assert c["source"] == "goodput"
    assert c["charged_s"] == pytest.approx(s["badput_s"]["straggler_compute"])
    assert c["charged_s"] == pytest.approx(STEPS * 0.01, rel=0.01)  # all of rank 0's work
    assert c["measured_s"] > 5 * c["charged_s"]
    note = (
        f"straggler_compute capped at rank 0's productive time: {c['measured_s']:.1f} s "
        f"measured, {c['charged_s']:.1f} s charged ({c['measured_s'] - c['charged_s']:.1f} s "
        "not charged"
    )
    assert note in text
    assert note in Path(s["html"]).read_text().replace("&#x27;", "'")
    # A charge that fits is not capped.
    full, _ = _report(capsys, _run(tmp_path / "fits"), tmp_path / "rep2")
    assert full["capped"] == {}
