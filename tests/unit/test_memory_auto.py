"""``checkpoint.memory.every_steps = "auto"``: after ``WARM`` unmeasured snapshots, the job
measures one (its blocking, its time to land, and how much it slowed the steps it
overlapped) over ``GAP`` steps, the planner picks K, and the job snapshots at exactly those
steps after."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.memory import auto as auto_mod
from steadytrain.checkpoint.memory.auto import GAP, WARM, AutoInterval
from steadytrain.checkpoint.memory.config import MemoryConfig
from steadytrain.errors import ConfigError
from steadytrain.planning.two_tier import memory_every_steps


def _run(tmp_path, mtbf_s: float, steps: int, step_s: float) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    events: list[dict] = []
    ck = Checkpointer(
        str(tmp_path / "ckpt"),
        mtbf_s=mtbf_s,
        memory={"every_steps": "auto", "dir": str(tmp_path / "mem")},
        on_event=events.append,
    )
    for step in range(1, steps + 1):
        time.sleep(step_s)  # the step's work
        ck.maybe_save(step, {"model": model, "optim": optim})
    ck.wait()
    ck._deliver()
    ck.close()
    return [e for e in events if e["type"] == "memory_snapshot"]


def test_frequent_failures_choose_every_step(tmp_path):
    last = 1 + WARM + GAP  # the snapshot whose agreement chooses K
    snaps = _run(tmp_path, mtbf_s=0.1, steps=last + 3, step_s=0.2)
    assert [e["step"] for e in snaps] == [*range(1, WARM + 2), *range(last, last + 4)], snaps
    chose = snaps[WARM + 1]
    assert chose["every_steps"] == 1, chose
    assert all("every_steps" not in e for e in snaps[: WARM + 1])  # measuring, not chosen
    assert set(chose["auto"]) == {"step_s", "cost_s", "interference_s", "landed_s"}
    assert chose["auto"]["step_s"] >= 0.2  # the sleeps are the step's work
    assert all(e["ok"] for e in snaps)


def test_rare_failures_choose_a_long_interval(tmp_path):
    snaps = _run(tmp_path, mtbf_s=1e9, steps=14, step_s=0.01)
    chosen = snaps[WARM + 1]["every_steps"]
    assert chosen > 14, snaps[-1]  # with failures once in 30 years, every step would waste
    # the measuring snapshots, and nothing more within 14 steps
    assert [e["step"] for e in snaps] == [*range(1, WARM + 2), 1 + WARM + GAP], snaps


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _measure(monkeypatch, durations: list[float], landed_after: int, block: float) -> dict:
    """Drive ``AutoInterval`` through its measuring steps on a fake clock: ``WARM``
    warm-up snapshots (slow: they must not count), then steps of ``durations`` seconds (the
    first one holds the measured snapshot's ``block``), the measured generation landing
    during step ``landed_after``."""
    clock = _Clock()
    monkeypatch.setattr(auto_mod.time, "perf_counter", clock)
    auto = AutoInterval(mtbf_s=3600.0, survives=0.75)
    for i in range(WARM):  # warm-up snapshots: costly, and not measured
        assert auto.due(7 + i, landed=True) is True
        assert auto.started(clock.t, 50.0) is None
        clock.t += 99.0
        auto.landed(40.0)
    first = 7 + WARM
    assert auto.due(first, landed=True) is True  # the measured snapshot
    assert auto.started(clock.t, block) is None
    due = []
    for i, d in enumerate(durations, start=1):
        clock.t += d
        due.append(auto.due(first + i, landed=i >= landed_after))
    assert due == [False] * (GAP - 1) + [True]  # the next snapshot GAP steps later
    auto.landed(0.5)  # the measured generation
    measured = auto.started(clock.t, block)
    assert auto.landed_s == 0.5  # the measured generation's, not a warm-up's
    assert auto.due(first + GAP + 1, landed=True) is None  # measuring is over
    return measured


def test_interference_is_what_the_overlapped_steps_lost(monkeypatch):
    # clean steps take 1.0 s; the two steps the generation overlapped took 1.5 s, the
    # first of them also held 0.2 s of blocking
    steps = [1.7, 1.5] + [1.0] * (GAP - 2)
    m = _measure(monkeypatch, steps, landed_after=2, block=0.2)
    assert m["step_s"] == pytest.approx(1.0)
    assert m["interference_s"] == pytest.approx(1.0)
    assert m["block_s"] == pytest.approx(1.2)  # the cost the planner gets: block + lost


def test_no_interference_when_the_generation_lands_at_once(monkeypatch):
    m = _measure(monkeypatch, [1.2] + [1.0] * (GAP - 1), landed_after=1, block=0.2)
    assert m["step_s"] == pytest.approx(1.0)
    assert m["interference_s"] == pytest.approx(0.0)
    assert m["block_s"] == pytest.approx(0.2)


def test_a_costlier_snapshot_gets_a_longer_interval(monkeypatch):
    cheap = _measure(monkeypatch, [1.2] + [1.0] * (GAP - 1), landed_after=1, block=0.2)
    costly = _measure(monkeypatch, [1.7, 1.5] + [1.0] * (GAP - 2), landed_after=2, block=0.2)
    ks = []
    for m in (cheap, costly):
        auto = AutoInterval(mtbf_s=3600.0, survives=0.75)
        ks.append(auto.choose([{**m, "landed_s": 0.5}, None]))
    assert ks[0] < ks[1], ks


def test_the_planner_answer_moves_with_the_failure_rate():
    args = dict(step_s=1.0, cost_s=0.05, landed_s=0.2, survives=0.75)
    ks = [memory_every_steps(mtbf_s=m, **args) for m in (60.0, 3600.0, 86400.0)]
    assert ks[0] < ks[1] < ks[2], ks
    assert memory_every_steps(mtbf_s=60.0, **{**args, "cost_s": 1e-6}) == 1


def test_auto_without_mtbf_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="mtbf_s"):
        Checkpointer(str(tmp_path / "c"), memory={"every_steps": "auto"})
    with pytest.raises(ConfigError, match="every_steps"):
        MemoryConfig(every_steps="sometimes")
    assert MemoryConfig(every_steps="3").every_steps == 3  # --set arrives as text
