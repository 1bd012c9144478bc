"""Shared fixtures of the training end-to-end tests (module-scoped to share start-up cost)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import make_dataset, run_torchrun  # noqa: E402

STEPS = 24


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_dataset(str(tmp_path_factory.mktemp("train-ds") / "ds"))


@pytest.fixture(scope="session")
def baseline(dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The uninterrupted reference run: 2 ranks, STEPS steps, no faults."""
    run_dir = str(tmp_path_factory.mktemp("train-baseline") / "run")
    run_torchrun(2, [f"run_dir={run_dir}", f"data.dataset={dataset}", f"train.max_steps={STEPS}"])
    return run_dir
