"""Shared fixtures of the training end-to-end tests (module-scoped to share start-up cost)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import make_dataset, prestart_warm, run_torchrun  # noqa: E402

STEPS = 24


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("train-ds")
    yield make_dataset(str(root / "ds"))
    shutil.rmtree(root, ignore_errors=True)  # session dirs outlive the retention policy


@pytest.fixture(scope="session")
def baseline(shared_dir) -> str:
    """The uninterrupted reference run: 2 ranks, STEPS steps, no faults, fresh ranks (the
    warm runs compared with it match interpreters that drew their own hash seeds). Tests
    only read it:
    one torchrun run per test run, shared by every worker (``shared_dir``), on its own
    dataset (a worker's ``dataset`` goes when that worker ends)."""

    def build(root: Path) -> None:
        data = make_dataset(str(root / "ds"))
        settings = [f"run_dir={root / 'run'}", f"data.dataset={data}", f"train.max_steps={STEPS}"]
        run_torchrun(2, settings, fresh=True)  # fresh ranks: the reference of exactness

    return str(shared_dir("train-baseline", build) / "run")


@pytest.fixture(scope="session", autouse=True)
def warm_workers() -> Iterator[None]:
    """The warm process the ranks of every run but the fresh ones fork from
    (``harness.warm_ranks``): started at this test process's first training test, so its
    preload overlaps that test's set-up (the dataset, the shared baseline); stopped by pid
    when the session ends, with a check that none of its workers outlived it
    (``warm_pool.stop_all``)."""
    prestart_warm()
    yield
    if "warm_pool" in sys.modules:
        sys.modules["warm_pool"].stop_all()
