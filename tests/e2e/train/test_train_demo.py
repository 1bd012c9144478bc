"""The demo's training stage, reduced: 2 ranks under torchrun, two injected crashes.

Compares what ``run_demo_training`` reports with the run's own files:
- it finishes all steps after exactly two automatic restarts (one mid-step crash, one crash
  while a checkpoint is written), each resuming from a committed checkpoint before the crash;
- goodput is a fraction in (0, 1) and is the report's (report.json of the run);
- the report it names exists; every step's samples and loss and the final weights equal the
  uninterrupted run's (exact resume): the shared ``baseline``, the same config and steps
  (its checkpoints every 4 steps too), so no reference run of its own.

Its ranks fork from the warm process (``run_demo_training(warm=...)``, the product's own
option); ``steadytrain demo`` itself, fresh ranks and the embedded config, is
``tests/e2e/test_demo_cli.py``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import STEPS  # noqa: E402
from harness import (  # noqa: E402
    BASE_SETTINGS,
    assert_same_run,
    ledger,
    warm_ranks,
    warm_workers_cpu,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

EVERY = 4  # the baseline's checkpoint.every_steps (harness.BASE_SETTINGS)


def test_demo_training_survives_two_crashes(dataset: str, baseline: str, tmp_path) -> None:
    from steadytrain.train.demo_run import demo_crash_steps, run_demo_training

    # Same tiny model as the other e2e tests (the demo's own config is bigger).
    settings = [s for s in BASE_SETTINGS if not s.startswith("checkpoint.every_steps")]
    lines: list[str] = []
    warm = warm_ranks()[1].get("STEADYTRAIN_WARM_SOCKET")  # None: not listening yet
    forked_cpu = warm_workers_cpu(warm) if warm else 0.0
    result = run_demo_training(
        str(tmp_path / "demo"),
        dataset,
        steps=STEPS,
        every_steps=EVERY,
        settings=settings,
        out=lines.append,
        warm=warm,
    )
    kill, save_kill = demo_crash_steps(STEPS, EVERY)
    assert result["crashes"] == [kill, save_kill] and save_kill % EVERY == 0
    assert result["steps"] == STEPS
    assert result["restarts"] == 2
    for crash, restored in zip(result["crashes"], result["restored_steps"], strict=True):
        assert restored % EVERY == 0 and crash - 2 * EVERY <= restored < crash
    assert 0.0 < result["goodput"] < 1.0
    with open(result["report_json"]) as f:
        assert result["goodput"] == json.load(f)["goodput"]
    assert os.path.exists(result["report"])
    assert any(line.startswith("[fault]") for line in lines)
    assert sum("[torchrun]" in line for line in lines) >= 2
    if warm:  # the ranks were forked there (and reaped), none of them started cold
        assert warm_workers_cpu(warm) > forked_cpu
        assert not [line for line in lines if line.startswith("[warm]")], lines

    # The same run without crashes: the same samples, losses and final weights.
    worlds = [r["world_size"] for r in ledger(result["run_dir"]) if r["type"] == "job_start"]
    assert worlds == [2, 2, 2], worlds
    assert_same_run(result["run_dir"], baseline, STEPS, global_batch=8)
