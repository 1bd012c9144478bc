"""Process-mode saves survive the death of DCP's checkpoint daemon (issue 12 item 3).

DCP starts its daemon once per process and keeps it for good; once it died, every later
save failed with ``BrokenPipeError`` and training went on with no checkpoints. Two real
gloo ranks save with ``async_mode="process"``; rank 0's daemon is SIGKILLed before step 2
(a new daemon is started on every rank) and again before step 3 (the restart budget is
spent: the job falls back to thread mode). Every save must commit.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)
from launch import launch  # noqa: E402

pytestmark = pytest.mark.dist


def _line(out: str, tag: str) -> str:
    return next(ln[len(tag) + 1 :] for ln in out.splitlines() if ln.startswith(tag + " "))


@pytest.mark.timeout(400)
def test_a_killed_checkpoint_daemon_is_replaced_then_thread_mode_takes_over(tmp_path):
    outs = launch(
        os.path.join(HERE, "daemon_worker.py"), [str(tmp_path / "ckpts")], world=2, timeout=360
    )
    for rank, out in enumerate(outs):
        events = json.loads(_line(out, "EVENTS"))
        saves = [e for e in events if e["type"] == "checkpoint"]
        assert [(e["step"], e["ok"]) for e in saves] == [(s, True) for s in range(1, 6)], out
        daemon = [e for e in events if e["type"] == "checkpoint_daemon"]
        assert [(e["step"], e["action"]) for e in daemon] == [
            (2, "restart"),
            (3, "fallback_thread"),
        ], out
        assert "rank 0: DCP's checkpoint daemon" in daemon[0]["reason"], daemon
        assert "exited with code -9" in daemon[0]["reason"], daemon
        assert all(e["every_steps"] == 1 for e in saves), saves  # for the recovery alert
        assert _line(out, "MODE") == "thread", rank
        assert _line(out, "RESTORED") == "5 5.0", rank
