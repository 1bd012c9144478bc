"""Fixtures of the integration tests (helpers: ``example_runs.py``)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e", "train"))

import warm_pool  # noqa: E402
from harness import make_dataset  # noqa: E402


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("integrations-ds")
    yield make_dataset(str(root / "ds"))
    shutil.rmtree(root, ignore_errors=True)  # session dirs outlive the retention policy


@pytest.fixture(scope="session", autouse=True)
def warm_workers() -> Iterator[None]:
    """The warm processes ``warm_pool.launch`` started in this test process, stopped (by
    pid, none of their workers left) when the session ends."""
    yield
    warm_pool.stop_all()
