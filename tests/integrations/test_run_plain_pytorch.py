"""A plain PyTorch DDP loop on ``steadytrain.Run`` (``plain_worker.py``) under the real
torchrun, 2 gloo ranks, ``--max-restarts 1``; the two runs go side by side:

- rank 1 SIGKILLed mid-step: torchrun restarts the job, which resumes and finishes; the
  report (``steadytrain report RUN_DIR --json``) lists the crash (rank 0's gloo "Connection
  reset by peer" is a crash, not the clean ``interpreter_exit``), a restart gap above 0 and
  "other" under 10 % of the wall time;
- rank 1 asleep forever mid-step in the user's own code: Run's hang watchdog detects it on
  both ranks, records the ``hang`` naming rank 1, exits 124 and torchrun restarts the job,
  as in ``steadytrain train``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from example_runs import finish
from harness import env, start_agent
from warm_pool import launch

from steadytrain.monitor.ledger import read_ledger
from steadytrain.testing import forkserver
from steadytrain.testing.incidents.common import report

# 480 s: the first run may wait up to 60 s for its warm process (warm_pool.READY_S), and at
# load ~20 the two runs and three reports took just past 300 s warm (221 s fresh at load 40).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_worker.py")
STEPS = 10


def start(data: str, run_dir: str, *args: str) -> subprocess.Popen | forkserver.ForkedProcess:
    """The worker under torchrun, its ranks forked from the worker's warm process
    (``warm_pool.py``): nothing here depends on a fresh interpreter's start-up."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    entry, warm_env = launch(WORKER)
    cmd += ["--monitor-interval=0.2", *entry, "--data", data, "--run-dir", run_dir]
    cmd += ["--steps", str(STEPS), "--every", "4", *args]
    return start_agent(cmd, env(**warm_env))


def test_plain_loop_crash_and_hang_under_torchrun(dataset: str, tmp_path) -> None:
    crashed, hung = str(tmp_path / "crashed"), str(tmp_path / "hung")
    procs = [
        start(dataset, crashed, "--crash-at-step", "7"),
        start(dataset, hung, "--hang-at-step", "6", "--watchdog-floor", "2"),
    ]
    outs = [finish(p) for p in procs]

    # -- the SIGKILLed rank ------------------------------------------------------------
    rep = report(crashed, plots=False)
    assert [c["attempt"] for c in rep["crashes"]] == [0], rep["crashes"]
    assert rep["crashes"][0]["reason"].startswith("error: "), rep["crashes"]
    assert rep["restarts"] == 1 and rep["last_step"] == STEPS
    assert rep["badput"]["restart_gap"] > 0, rep["badput"]
    assert rep["badput"]["startup"] > 0, rep["badput"]
    assert rep["badput"]["other"] < 0.10, rep["badput"]
    recs = read_ledger(os.path.join(crashed, "ledger.jsonl"))
    assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished"
    assert any(r["type"] == "checkpoint" and r["ok"] and r["step"] == STEPS for r in recs)

    # -- the hung rank -----------------------------------------------------------------
    assert "[watchdog] rank 1: no progress" in outs[1], outs[1][-4000:]
    recs = read_ledger(os.path.join(hung, "ledger.jsonl"))
    hangs = [r for r in recs if r["type"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["stuck_ranks"] == [1], hangs
    assert hangs[0]["attempt"] == 0 and hangs[0]["step"] == 5
    starts = [r for r in recs if r["type"] == "job_start"]
    assert [s["attempt"] for s in starts] == [0, 1] and starts[1]["restored_step"] == 4
    assert os.path.exists(os.path.join(hung, "hangs", "attempt-0", "rank-1.txt"))
    rep = report(hung, plots=False)
    assert rep["last_step"] == STEPS and rep["badput"]["restart_gap"] > 0
