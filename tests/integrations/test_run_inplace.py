"""``Run`` with in-place recovery on (``recovery.inplace``), under the real torchrun, 2 gloo
ranks, DDP, the keeper, ``--max-restarts 1`` (a whole restart is possible, so its absence
means something): ``inplace_run_worker.py`` run uninterrupted and with rank 0 SIGKILLed
mid-step (between its forward and its backward, the other rank blocked in DDP's
all-reduce), side by side. The victim is rank 0, whose ledger the replaced process then
keeps. The killed run:

- is never restarted by torchrun (every step record has restart count 0), and the
  survivor's training process keeps its pid; only rank 0's process is new;
- recovers from the survivor's live state (``Run``'s default: no in-memory snapshot): the
  survivor goes on from the start of the failed step 7, which the replaced rank 0 receives;
- has one ``inplace_recovery`` record in its ledger: path ``in_place``, rank 0 lost at
  step 7, resumed at step 7, with its phases; and the goodput ledger books the gap as a
  restart (a second ``job_start`` whose restored step is 7, dated from the replaced
  process's birth, after the first attempt started);
- is exact: every step's loss on each rank (the redone one too) and the final weights
  equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from example_runs import assert_same_as_uninterrupted, finish, jsonl
from warm_pool import start_inplace

from steadytrain.report.build import build_report
from steadytrain.testing import forkserver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "inplace_run_worker.py")
STEPS, KILL_AT = 12, 7  # the fault at 7 resumes at 7 (live: nothing is redone)


def start(run_dir: str, kill_at: int) -> subprocess.Popen | forkserver.ForkedProcess:
    return start_inplace(WORKER, run_dir, str(STEPS), str(kill_at), "0")


def test_run_recovers_a_sigkilled_rank_in_place_and_stays_exact(tmp_path) -> None:
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    procs = [start(ref, 0), start(killed, KILL_AT)]
    logs = [finish(p) for p in procs]
    log = logs[1]

    assert "rank 0: process" in log and "replacing it in place (1 of 3)" in log, log[-4000:]
    replaced, kept = (jsonl(os.path.join(killed, f"r{r}.jsonl")) for r in (0, 1))
    assert {r["restart"] for r in kept + replaced} == {"0"}, "torchrun restarted the job"
    assert len({r["pid"] for r in kept}) == 1, "the survivor's process was replaced"
    assert [r["step"] for r in kept] == list(range(STEPS))  # step 7 once: it failed, then ran
    assert [r["step"] for r in replaced if r["incarnation"] == 1] == list(range(KILL_AT, STEPS))
    assert_same_as_uninterrupted(ref, killed, STEPS)  # losses, redone ones too; weights

    ledger = jsonl(os.path.join(killed, "ledger.jsonl"))
    recs = [r for r in ledger if r["type"] == "inplace_recovery"]
    assert len(recs) == 1, recs
    rec = recs[0]
    assert (rec["path"], rec["failed_ranks"], rec["from_step"], rec["step"]) == (
        "in_place",
        [0],
        KILL_AT,
        KILL_AT,
    )
    assert set(rec["phases"]) >= {"detection_s", "regroup_s", "restore_s", "redo_s"}
    assert "resumed from the survivors' live state at the start of step 7" in rec["why"], rec
    starts = [r for r in ledger if r["type"] == "job_start"]
    assert [s["restored_step"] for s in starts] == [0, KILL_AT]  # the gap is a restart's
    # the replacement's start-up counts from its fork, not from its keeper's birth
    assert starts[0]["t"] < starts[1]["born_t"] < starts[1]["t"], starts
    assert starts[1]["startup_s"] < starts[1]["t"] - starts[0]["t"], starts
    # The report: the recovery and its path; its gap a restart, in phases, never productive
    # time (whether the rolled-back step counts as lost depends on whether the killed
    # process's meter had written it: not asserted).
    report = build_report(killed)
    assert [(r["path"], r["failed_ranks"]) for r in report["recoveries"]] == [("in_place", [0])]
    (restart,) = report["restart_phases"]
    assert (restart["after"], restart["attempt"]) == (0, 1) and restart["wall_s"] > 0
    assert report["badput_s"]["startup"] > starts[0]["startup_s"]  # the in-place start-up too
    assert build_report(ref)["recoveries"] == []
