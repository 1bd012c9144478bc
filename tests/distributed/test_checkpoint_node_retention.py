"""Retention of node-local staging copies on nodes other than rank 0's.

With a remote destination every rank stages its files in a node-local directory, but only
rank 0 writes COMMIT there. Compares, after 7 saves with keep_last=2, the checkpoint
directories left in each rank's local directory and on the remote: rank 1's local copies
must be trimmed to the newest few (they would otherwise pile up forever) and must include
the newest committed step; the remote keeps exactly the last 2 committed checkpoints.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)
from launch import launch  # noqa: E402

pytestmark = pytest.mark.dist

STEPS, KEEP = 7, 2


def _step_dirs(path: str) -> list[str]:
    return sorted(d for d in os.listdir(path) if d.startswith("step-"))


@pytest.mark.timeout(180)
def test_node_local_copies_are_trimmed_on_every_node(tmp_path):
    worker = os.path.join(HERE, "node_retention_worker.py")
    outs = launch(worker, [str(tmp_path), str(STEPS), str(KEEP)], world=2)
    assert all("ok" in o for o in outs)
    newest = f"step-{STEPS:08d}"
    remote = _step_dirs(str(tmp_path / "remote"))
    assert remote == [f"step-{s:08d}" for s in range(STEPS - KEEP + 1, STEPS + 1)]
    for rank in (0, 1):
        local = _step_dirs(str(tmp_path / f"node{rank}"))
        assert newest in local, (rank, local)
        assert len(local) <= KEEP + 1, (rank, local)
    # Rank 1 never sees a COMMIT locally: the trimming comes from what it saw commit.
    assert not any(
        os.path.exists(tmp_path / "node1" / d / "COMMIT")
        for d in _step_dirs(str(tmp_path / "node1"))
    )
