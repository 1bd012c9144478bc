"""Fault injection: a scheduled crash is a real SIGKILL and fires once per run; random
failures are drawn from the seed and counted from the run's first start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from steadytrain.testing import forkserver
from steadytrain.train.config import FaultConfig
from steadytrain.train.faults import FaultInjector

CHILD = """
import sys
from steadytrain.train.config import FaultConfig
from steadytrain.train.faults import FaultInjector
inj = FaultInjector(FaultConfig(kill_at_steps=[3], kill_in_save_at_steps=[4]), sys.argv[1], 0)
for step in range(1, 6):
    inj.mid_step(step)
    inj.after_save_started(step)
    print(step, flush=True)
"""


def _run(run_dir: str) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, "-c", CHILD, run_dir], timeout=60)


def test_scheduled_crashes_are_sigkill_and_fire_once(tmp_path) -> None:
    first = _run(str(tmp_path))
    assert first.returncode == -signal.SIGKILL
    assert first.stdout.split() == ["1", "2"]  # died inside step 3, before printing it
    assert "crash in the middle of step 3" in first.stderr
    second = _run(str(tmp_path))  # the restarted attempt: step 3 passes, the save at 4 dies
    assert second.returncode == -signal.SIGKILL
    assert second.stdout.split() == ["1", "2", "3"]
    third = _run(str(tmp_path))
    assert third.returncode == 0 and third.stdout.split() == ["1", "2", "3", "4", "5"]
    assert sorted(os.listdir(tmp_path / "faults")) == ["kill-3.fired", "kill_in_save-4.fired"]


def test_other_ranks_are_spared(tmp_path) -> None:
    inj = FaultInjector(FaultConfig(kill_at_steps=[1], kill_rank=1), str(tmp_path), rank=0)
    inj.mid_step(1)  # rank 0 is not the target: nothing happens
    assert not os.listdir(tmp_path / "faults")


def test_random_failure_times_come_from_the_seed_and_the_first_start(tmp_path) -> None:
    cfg = FaultConfig(mtbf_s=10.0, seed=5)
    a = FaultInjector(cfg, str(tmp_path / "a"), rank=0)
    time.sleep(0.01)
    b = FaultInjector(cfg, str(tmp_path / "a"), rank=0)  # a restart: same run, same t0
    assert a._failure_times[:5] == b._failure_times[:5]
    c = FaultInjector(FaultConfig(mtbf_s=10.0, seed=6), str(tmp_path / "c"), rank=0)
    gaps_a = [y - x for x, y in zip(a._failure_times, a._failure_times[1:101], strict=False)]
    gaps_c = [y - x for x, y in zip(c._failure_times, c._failure_times[1:101], strict=False)]
    assert gaps_a != gaps_c
    assert 5.0 < sum(gaps_a) / len(gaps_a) < 20.0  # mean ~ MTBF
    spared = FaultInjector(cfg, str(tmp_path / "a"), rank=1)
    assert spared._failure_times == []  # only kill_rank (0) draws failures
