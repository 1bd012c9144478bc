"""The demo's training stage, reduced: 2 ranks under torchrun, two injected crashes.

Compares what ``run_demo_training`` reports with the run's own files:
- it finishes all steps after exactly two automatic restarts (one mid-step crash, one crash
  while a checkpoint is written), each resuming from a committed checkpoint before the crash;
- goodput is a fraction in (0, 1) and is the report's (report.json of the run);
- the report it names exists; the final weights equal an uninterrupted run's (exact resume).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import BASE_SETTINGS, final  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

STEPS, EVERY = 30, 5


def test_demo_training_survives_two_crashes(dataset: str, tmp_path) -> None:
    from steadytrain.train.demo_run import demo_crash_steps, run_demo_training

    # Same tiny model as the other e2e tests (the demo's own config is bigger).
    settings = [s for s in BASE_SETTINGS if not s.startswith("checkpoint.every_steps")]
    lines: list[str] = []
    result = run_demo_training(
        str(tmp_path / "demo"),
        dataset,
        steps=STEPS,
        every_steps=EVERY,
        settings=settings,
        out=lines.append,
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

    # The same run without crashes ends with the same weights.
    ref = run_demo_training(
        str(tmp_path / "ref"),
        dataset,
        steps=STEPS,
        every_steps=EVERY,
        crashes=[],
        save_crashes=[],
        settings=settings,
        out=None,
    )
    assert ref["restarts"] == 0
    assert final(result["run_dir"])["weights"] == final(ref["run_dir"])["weights"]
