"""Shared fixtures of the training end-to-end tests (module-scoped to share start-up cost)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import make_dataset, run_torchrun  # noqa: E402

STEPS = 24


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("train-ds")
    yield make_dataset(str(root / "ds"))
    shutil.rmtree(root, ignore_errors=True)  # session dirs outlive the retention policy


@pytest.fixture(scope="session")
def baseline(dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The uninterrupted reference run: 2 ranks, STEPS steps, no faults."""
    root = tmp_path_factory.mktemp("train-baseline")
    run_dir = str(root / "run")
    run_torchrun(2, [f"run_dir={run_dir}", f"data.dataset={dataset}", f"train.max_steps={STEPS}"])
    yield run_dir
    shutil.rmtree(root, ignore_errors=True)
