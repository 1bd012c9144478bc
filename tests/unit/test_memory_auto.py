"""``checkpoint.memory.every_steps = "auto"``: the job measures two snapshots, the planner
picks K, and the job snapshots at exactly those steps after."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
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
    snaps = _run(tmp_path, mtbf_s=0.1, steps=6, step_s=0.2)
    assert [e["step"] for e in snaps] == [1, 2, 3, 4, 5, 6], snaps
    assert snaps[1]["every_steps"] == 1, snaps[1]
    assert all(e["ok"] for e in snaps)


def test_rare_failures_choose_a_long_interval(tmp_path):
    snaps = _run(tmp_path, mtbf_s=1e9, steps=12, step_s=0.01)
    chosen = snaps[1]["every_steps"]
    assert chosen > 12, snaps[1]  # with failures once in 30 years, every step would waste
    assert [e["step"] for e in snaps] == [1, 2], snaps  # nothing more within 12 steps


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
