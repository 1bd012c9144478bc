"""A SIGSTOPped rank is SIGKILLed on its own node, and the job restarts before the backend
timeout (issue 26, item 5).

Real ``torchrun`` with 2 ranks on CPU (gloo), ``--max-restarts 1``: rank 1 stops itself
(``SIGSTOP``) in step HANG_STEP, before the step's loss all-reduce. Every thread of a
stopped process stops, its watchdog's too, and torchrun's SIGTERM stays pending on it, so
before the reaper torchrun waited out its 30 s grace before the restart. Now:
- rank 0's watchdog names rank 1 (no response) and publishes its decision;
- rank 1's reaper (its child process, monitor/reaper.py) SIGKILLs it and publishes
  ``reaped-rank-1.json`` with the ``/proc`` state it saw: ``T``, stopped;
- torchrun never has to force a worker down (it logs when its grace runs out), and the
  second attempt starts, from the last step, well before the configured backend timeout
  (BACKEND_TIMEOUT_S, a setting of the run: a logical bound, not a speed measurement);
- the job finishes.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import HANG_WARM_WAIT_S, final, ledger, run_torchrun  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

STEPS = 8
HANG_STEP = 6  # after warm-up (3 steps) and the checkpoint of step 4 (every 4 steps)
BACKEND_TIMEOUT_S = 120.0
SETTINGS = [
    f"train.backend_timeout_s={BACKEND_TIMEOUT_S}",
    "monitor.watchdog.floor_s=5",
    "monitor.watchdog.poll_s=0.25",
    "monitor.watchdog.grace_s=5",
    "monitor.watchdog.warmup_steps=3",
    "monitor.watchdog.init_s=60",
    "monitor.watchdog.checkpoint_s=60",  # every deadline (+ grace) below the backend's
]


def test_a_stopped_rank_is_reaped_and_the_job_restarts_before_the_backend_timeout(
    dataset: str, tmp_path
) -> None:
    from steadytrain.monitor.ranks import read_ranks
    from steadytrain.monitor.reaper import proc_state

    run_dir = str(tmp_path / "run")
    done = run_torchrun(
        2,
        [f"run_dir={run_dir}", f"data.dataset={dataset}", f"train.max_steps={STEPS}"] + SETTINGS,
        faults=f"hang_at_step={HANG_STEP};hang_rank=1;hang_mode=sigstop",
        max_restarts=1,
        timeout=160,
        warm_wait_s=HANG_WARM_WAIT_S,  # a preload must not eat the whole-test timeout
    )
    assert final(run_dir)["step"] == STEPS
    assert "[fault] rank 1: hangs" in done.stderr
    assert "reach the backend's collective timeout" not in done.stderr
    # torchrun's grace ran out on no worker: it never had to SIGKILL one itself.
    assert "Unable to shutdown process" not in done.stderr, done.stderr[-4000:]

    records = ledger(run_dir)
    hang = next(r for r in records if r["type"] == "hang")
    assert hang["stuck_ranks"] == [1] and hang["missing_ranks"] == [1], hang
    assert hang["cause"] == "no response" and hang["attempt"] == 0

    # The reaper's record: rank 1's own pid of attempt 0, seen stopped, killed.
    d = os.path.join(run_dir, "hangs", "attempt-0")
    with open(os.path.join(d, "reaped-rank-1.json")) as f:
        reaped = json.load(f)
    view = read_ranks(run_dir)
    start = next(a for a in view.ranks[1].attempts if a["attempt"] == 0)
    assert reaped["pid"] == start["pid"] and reaped["node"] == start["node"], (reaped, start)
    assert reaped["proc_state"] == "T" and reaped["proc_state_name"] == "stopped", reaped
    assert reaped["signal"] == "SIGKILL" and reaped["rank"] == 1 and reaped["attempt"] == 0
    # Whichever came first: the reaper saw rank 0's decision, or torchrun's SIGTERM (sent
    # once rank 0 exited) reached the reaper in the stopped rank's process group.
    assert reaped["reason"] in ("stopped", "stopped at SIGTERM"), reaped
    assert "[reaper] rank 1" in done.stderr
    assert not os.path.exists(os.path.join(d, "reaped-rank-0.json"))  # rank 0 exited itself
    st = proc_state(reaped["pid"])
    assert st is None or st.state in "ZX", st  # the stopped process is gone

    # The restart: from the last checkpoint, after the kill, before the backend timeout.
    starts = [r for r in records if r["type"] == "job_start"]
    # Step 4's save may still be in flight in the stopped process (its threads stop too).
    assert len(starts) == 2 and starts[1]["restored_step"] in (0, 4), starts
    last_step = max(
        (r for r in records if r["type"] == "step" and r["t"] < starts[1]["t"]),
        key=lambda r: r["t"],
    )
    assert last_step["step"] == HANG_STEP - 1
    restart_t = starts[1]["t"] - starts[1]["startup_s"] - starts[1]["restore_s"]
    assert hang["detect_t"] <= reaped["t"] <= restart_t, (hang["detect_t"], reaped, restart_t)
    assert restart_t - last_step["t"] < BACKEND_TIMEOUT_S, restart_t - last_step["t"]
