"""Repeat saves on 2 real ranks over gloo: the ranks agree, every save, whether all of them
can write the plan DCP made before; when one rank's layout changes, all plan again
(checkpoint/repeat_save.py), and what was saved restores exactly."""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)
from launch import launch  # noqa: E402

pytestmark = pytest.mark.dist


@pytest.mark.timeout(180)
def test_ranks_reuse_together_and_plan_again_when_one_layout_changes(tmp_path):
    outs = launch(os.path.join(HERE, "repeat_worker.py"), [str(tmp_path)], world=2)
    assert all("repeat ok" in o for o in outs)
    commit = json.loads((tmp_path / "step-00000004" / "COMMIT").read_text())
    assert {f["rank"] for f in commit["files"]} == {0, 1}
