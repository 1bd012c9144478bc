"""SIGTERM reaches a rank blocked in a collective (issue 44, run_stuck.py).

Two real processes over gloo run ``sigterm_worker.py``; the test stops rank 1 (SIGSTOP), so
rank 0 blocks inside ``all_reduce`` -- a C++ call, where Python's SIGTERM handler cannot run
(before issue 44 it stayed there until the launcher's SIGKILL: no exit in 40 s measured).
Then SIGTERM to rank 0, as torchrun's agent sends it:

- with ``sigterm_exit_s`` (default 2 s) it exits by itself with 143 and its ledger ends with
  the crash ``job_end`` ``signal: SIGTERM``, as a rank at a step boundary records it;
- with ``sigterm_exit_s = 0`` (the watcher off) it is still blocked ``GRACE`` seconds later:
  the setting reaches the code, and the old behaviour is what the watcher changes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from steadytrain.monitor.ledger import read_ledger
from steadytrain.testing import forkserver
from steadytrain.testing.ports import free_ports

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sigterm_worker.py")
GRACE = 20.0  # far beyond the 2 s setting: exiting within it is the watcher's doing


def _start(run_dir: str, exit_s: float) -> list[forkserver.ForkedProcess | subprocess.Popen]:
    port = free_ports(1)[0]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        # Forked from the fork server: a process of its own (its pid takes SIGSTOP and
        # SIGTERM alone), without paying a fresh interpreter's torch import per rank.
        procs.append(
            forkserver.popen([sys.executable, WORKER, run_dir, str(exit_s)], env=env, merge=False)
        )
    return procs


def _steps(run_dir: str) -> int:
    try:
        return sum(r["type"] == "step" for r in read_ledger(os.path.join(run_dir, "ledger.jsonl")))
    except OSError:
        return 0


@pytest.mark.parametrize("exit_s", [2.0, 0.0])
def test_sigterm_reaches_a_rank_blocked_in_a_collective(tmp_path, exit_s: float) -> None:
    run_dir = str(tmp_path / "run")
    procs = _start(run_dir, exit_s)
    try:
        deadline = time.monotonic() + 120
        while _steps(run_dir) < 3:
            assert time.monotonic() < deadline, "no steps in 120 s"
            assert procs[0].poll() is None, procs[0].communicate(timeout=60)[1][-3000:]
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 0 now blocks in the all-reduce
        time.sleep(1.0)
        steps = _steps(run_dir)
        time.sleep(0.5)
        assert _steps(run_dir) == steps, "rank 0 is not blocked"
        os.kill(procs[0].pid, signal.SIGTERM)
        try:
            rc = procs[0].wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            rc = None
        if exit_s == 0:
            assert rc is None, "with the watcher off, a blocked rank cannot see SIGTERM"
            return
        err = procs[0].communicate(timeout=60)[1]
        assert rc == 128 + signal.SIGTERM, (rc, err[-3000:])
        assert "while the loop was inside a C++ call" in err, err[-3000:]
        recs = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
        assert recs[-1]["type"] == "job_end", recs[-3:]
        assert recs[-1]["reason"] == "signal: SIGTERM", recs[-1]
        assert recs[-1]["step"] == steps, (recs[-1], steps)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.wait()
