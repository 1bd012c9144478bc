"""The integration tests' runs: the examples under torchrun, and what a resume must match.

Each example in ``examples/`` is run as a user would run it: a script under the real
``torchrun`` (2 ranks, gloo, CPU), once uninterrupted and once with a SIGKILL mid-step that
torchrun recovers from with ``--max-restarts 1``. The two runs go side by side: most of
their time is interpreter and library start-up, which overlaps well even on 2 cores. The
workers are forked from a warm process per example (``warm_pool.py``; fresh with
``STEADYTRAIN_TEST_FRESH=1``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e", "train"))

from harness import REPO, env, kill_tree, start_agent  # noqa: E402
from warm_pool import launch  # noqa: E402

from steadytrain.testing import forkserver  # noqa: E402
from steadytrain.testing.incidents.common import report  # noqa: E402

EXAMPLES = os.path.join(REPO, "examples")
STEPS = 12
# A crash after the save of step 8 started: that save waited for step 4's to commit (one
# save in flight at most), so the restart must resume from step 4 or 8, never from 0.
CRASH_AT = 10


def start_example(
    script: str,
    data: str,
    run_dir: str,
    crash_at: int = 0,
    nproc: int = 2,
    *extra: str,
    fresh: bool = False,
) -> subprocess.Popen | forkserver.ForkedProcess:
    """``torchrun --nproc-per-node NPROC --max-restarts 1 examples/SCRIPT ... EXTRA`` in the
    background; its ranks forked from a warm process unless ``fresh``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += ["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    entry, warm_env = launch(os.path.join(EXAMPLES, script), fresh)  # a warm process's fork
    cmd += ["--monitor-interval=0.2", *entry]
    cmd += ["--data", data, "--run-dir", run_dir, "--steps", str(STEPS)]
    if crash_at:
        cmd += ["--crash-at-step", str(crash_at)]
    cmd += extra
    return start_agent(cmd, env(**warm_env))


def finish(proc: subprocess.Popen | forkserver.ForkedProcess, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out\n{out[-8000:]}") from None
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{out[-8000:]}"
    return out


def run_pair(script: str, data: str, tmp: str, fresh: bool = False) -> tuple[str, str]:
    """An uninterrupted run and a crashed-and-resumed run of ``script``; their run dirs."""
    ref, crashed = os.path.join(tmp, "ref"), os.path.join(tmp, "crashed")
    procs = [
        start_example(script, data, ref, fresh=fresh),
        start_example(script, data, crashed, CRASH_AT, fresh=fresh),
    ]
    for proc in procs:
        finish(proc)
    return ref, crashed


def losses(run_dir: str, attempt: int) -> dict[int, float]:
    """Rank 0's mean-over-ranks loss of every step that ``attempt`` finished."""
    path = os.path.join(run_dir, f"losses-attempt{attempt}.jsonl")
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r}


def final(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "final.json")) as f:
        return json.load(f)


def assert_bit_exact_resume(ref: str, crashed: str) -> None:
    """The crashed run ends where the uninterrupted one does, bit for bit, and its ledger
    shows the crash: two attempts, the second restored from a checkpoint before the crash."""
    from steadytrain.monitor.ledger import read_ledger

    want = losses(ref, 0)
    assert sorted(want) == list(range(1, STEPS + 1))
    first, second = losses(crashed, 0), losses(crashed, 1)
    assert sorted(first) == list(range(1, CRASH_AT))  # killed inside step CRASH_AT
    starts = [
        r for r in read_ledger(os.path.join(crashed, "ledger.jsonl")) if r["type"] == "job_start"
    ]
    assert [s["attempt"] for s in starts] == [0, 1]
    restored = starts[1]["restored_step"]
    assert restored in (4, 8), restored
    assert sorted(second) == list(range(restored + 1, STEPS + 1))
    for step, loss in {**first, **second}.items():  # floats compared exactly
        assert loss == want[step], f"step {step}: {loss} != {want[step]}"
    assert final(crashed) == final(ref) == {"step": STEPS, "weights": final(ref)["weights"]}
    # The restore that opened attempt 1 names the committed checkpoint it loaded; the last
    # step is committed too. (A save's own event reaches the ledger only at the next step,
    # so attempt 0's record of the checkpoint it left may be missing: not checked.)
    records = read_ledger(os.path.join(crashed, "ledger.jsonl"))
    restores = [r for r in records if r["type"] == "restore"]
    assert [r["step"] for r in restores] == [0, restored]
    assert restores[1]["path"].endswith(f"step-{restored:08d}")
    assert any(r["type"] == "checkpoint" and r["ok"] and r["step"] == STEPS for r in records)


def assert_crash_reported(crashed: str) -> None:
    """The crashed run's report (``steadytrain report RUN_DIR --json``), as ``steadytrain
    train`` gets it through ``steadytrain.Run``: the first attempt is a crash (rank 0 died
    of gloo's "Connection reset by peer", never the clean ``interpreter_exit``), the restart
    gap and the start-up are booked, and "other" holds under 10 % of the wall time."""
    rep = report(crashed, plots=False)
    assert [c["attempt"] for c in rep["crashes"]] == [0], rep["crashes"]
    assert rep["crashes"][0]["reason"] not in ("finished", "interpreter_exit", "killed")
    assert rep["restarts"] == 1, rep["restarts"]
    badput = rep["badput"]
    assert badput["restart_gap"] > 0, badput
    assert badput["startup"] > 0, badput
    assert badput["other"] < 0.10, badput


def assert_finished_without_hang(run_dir: str, steps: int, stderr: str) -> None:
    """A trainer-callback run's ledger: every step 1..steps, no hang, one clean end, and no
    watchdog line on stderr (nothing fired, nothing was killed)."""
    from steadytrain.monitor.ledger import read_ledger

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, steps + 1))
    assert not [r for r in records if r["type"] == "hang"], stderr[-4000:]
    assert [r["reason"] for r in records if r["type"] == "job_end"] == ["finished"]
    assert "[watchdog]" not in stderr and "[reaper]" not in stderr, stderr[-4000:]


def assert_evaluations_are_eval(run_dir: str, evaluated_s: float, each_s: float) -> None:
    """The ledger, the report and the plan of a run whose evaluations (``evaluated_s`` in
    all, each at least ``each_s``) fall on its save steps 4 and 8: every evaluated second
    is in ``eval`` (the eval phase spans the Trainer's own timing of it), none in a data
    wait or a save, and ``plan --from-run`` plans from the saves' own cost."""
    from steadytrain.monitor.ledger import read_ledger
    from steadytrain.planning.from_run import plan_from_run

    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    steps = [r for r in records if r["type"] == "step"]
    ckpts = [r for r in records if r["type"] == "checkpoint"]
    assert [r["step"] for r in ckpts] == [4, 8]
    for r in steps:  # no data wait and no save holds an evaluation
        assert r["data_wait_s"] < each_s and r["checkpoint_block_s"] < each_s, r
    rep = report(run_dir, plots=False)
    assert rep["badput_s"]["eval"] >= evaluated_s, rep["badput_s"]
    assert rep["badput_s"]["data_wait"] + rep["badput_s"]["checkpoint_block"] < each_s
    assert rep["ranks"][0]["data_wait_share"] < 0.5, rep["ranks"]
    plan = plan_from_run(run_dir, simulate_runs=0)
    measured = plan["measured"]
    assert plan["sources"]["ckpt_cost_s"] == "measured"
    assert plan["ckpt_cost_s"] == pytest.approx(sum(r["block_s"] for r in ckpts) / 2)
    assert plan["ckpt_cost_s"] < each_s
    assert measured["badput"]["eval"] == pytest.approx(rep["badput"]["eval"], rel=0.05)


# torchrun's agent logs one line per failed attempt: its first failure.
_FIRST_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) ")


def assert_kill_reported(out: str, killed: int) -> None:
    """torchrun's agent saw an attempt fail, and where its line names the SIGKILLed local rank
    ``killed`` it says ``exitcode: -9`` (a warm entry that ended otherwise, e.g. by status
    137, fails this in the usual order of events).

    Not "it always names the killed rank": the agent logs the first failure it has seen at the
    poll where one ends (``SubprocessContext._poll``). A fresh rank's SIGKILL ends the process
    the agent watches before any peer notices; a rank forked from a warm process ends through
    its entry (``steadytrain.warm.enter``), one process later, and on a loaded machine a
    survivor's error (~150 ms after the kill) can reach a poll first and alone (CI on 71b03fe
    and c304ded). That the entry ends by SIGKILL is checked without that race in
    ``tests/unit/test_warm.py``; which rank failed is read from the run's own records."""
    lines = [(int(code), int(rank)) for code, rank in _FIRST_FAILURE.findall(out)]
    assert lines, out[-4000:]  # torchrun saw the crash's attempt fail
    assert all(code == -9 for code, rank in lines if rank == killed), (lines, out[-4000:])


# The crash inside a save: rank 0 is killed once step SAVE_CRASH's shards are written and
# the ledger holds the step, before its COMMIT (steadytrain.testing.trainer_faults); the
# restart must skip that partial checkpoint and resume from step SAVE_CRASH - 4.
SAVE_CRASH = 8


def run_kills(script: str, data: str, tmp: str, nproc: int, *extra: str) -> dict[str, str]:
    """Three runs of ``script`` side by side: uninterrupted (``ref``), SIGKILLed at the start
    of step CRASH_AT (``mid_step``) and inside the save of step SAVE_CRASH (``mid_save``);
    their run dirs by name, once all three finished (torchrun recovered the crashes)."""
    dirs = {name: os.path.join(tmp, name) for name in ("ref", "mid_step", "mid_save")}
    procs = {
        "ref": start_example(script, data, dirs["ref"], 0, nproc, *extra),
        "mid_step": start_example(script, data, dirs["mid_step"], CRASH_AT, nproc, *extra),
        "mid_save": start_example(
            script, data, dirs["mid_save"], 0, nproc, *extra, "--crash-in-save", str(SAVE_CRASH)
        ),
    }
    outs = {name: finish(proc) for name, proc in procs.items()}
    assert_kill_reported(outs["mid_step"], killed=1)
    assert_kill_reported(outs["mid_save"], killed=0)
    return dirs


def assert_restored(run_dir: str, steps: tuple[int, ...], skipped: str = "") -> dict[str, Any]:
    """``steadytrain report``: one crash (attempt 0), one restart, restored from durable
    storage at one of ``steps``, and, with ``skipped``, that checkpoint named as passed over.
    Returns the report."""
    rep = report(run_dir, plots=False)
    assert [c["attempt"] for c in rep["crashes"]] == [0], rep["crashes"]
    assert rep["restarts"] == 1, rep["restarts"]
    [row] = rep["restores"]
    assert row["tier"] == "durable" and row["step"] in steps, row
    if skipped:
        passed = rep["restores_passed_over"]
        assert [(k["attempt"], k["path"]) for k in passed] == [(1, skipped)], passed
    assert rep["last_step"] == STEPS
    return rep


def jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def assert_same_as_uninterrupted(ref: str, killed: str, steps: int, ranks: int = 2) -> None:
    """The in-place ``Run`` workers (inplace_run_worker.py, inplace_fsdp_worker.py): every
    step's loss on each rank, the redone steps too, and the final weights of the killed run
    equal the uninterrupted run's, bit for bit."""
    import torch

    for rank in range(ranks):
        want = {r["step"]: r["loss"] for r in jsonl(os.path.join(ref, f"r{rank}.jsonl"))}
        assert sorted(want) == list(range(steps))
        for r in jsonl(os.path.join(killed, f"r{rank}.jsonl")):
            assert r["loss"] == want[r["step"]], (rank, r, want[r["step"]])
    expected = torch.load(os.path.join(ref, "final.pt"))
    got = torch.load(os.path.join(killed, "final.pt"))
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
