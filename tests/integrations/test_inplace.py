"""In-place recovery of a SIGKILLed rank (``steadytrain.inplace``) under the real torchrun, 2
and 3 gloo ranks, DDP, ``--max-restarts 1`` (a whole restart is possible, so its absence means
something). Runs of ``inplace_worker.py``, side by side in each test:

- uninterrupted: the reference;
- 2 ranks: rank 1; 3 ranks: the middle rank 1; SIGKILLed mid-step (between its forward
  and its backward, the others blocked in DDP's all-reduce, their optimizers not stepped),
  with live recovery alone (no snapshot: ``every_steps=0``): the survivors go on from the
  start of the failed step 7 that they hold live, the replacement receives it, nothing
  before 7 is redone;
- 2 ranks: rank 1 SIGKILLed inside its ``optimizer.step()`` of step 7 (``instep``, after
  the gradient all-reduce; no collective after ``optimizer.step()``), live alone: the
  survivor finishes step 7 and is live at 8; the replacement reads the per-rank state of 8
  that its predecessor's optimizer pre-hook published, and everyone goes on from 8;
- 2 ranks: rank 0 SIGKILLed after its ``optimizer.step()`` of step 7, before the step's
  loss all-reduce (``late``: the survivor stepped too, so nothing is live), with snapshots
  every 3 steps: everyone rolls back to the snapshot of step 6 and redoes from there;
- in each: torchrun's agent never restarts (every record has restart count 0, the
  survivors' processes and every keeper keep their pids), the killed rank's training
  process alone is new (forked by the same keeper), and every step's loss on each rank, the
  redone ones included, and the final weights equal the reference's bit for bit;
- 2 ranks: rank 1 SIGSTOPped mid-step, every rank running the hang watchdog with in-place
  recovery on: rank 0's watchdog decides rank 1 hung (its reaper says it is stopped), the
  reaper SIGKILLs it, rank 0 does not exit, and the run recovers in place as above;
- the same fault repeating (rank 1's replacement dies before completing a step): the
  keeper leaves it to torchrun's whole restart, which finishes the job (attempt 1);
- a replacement that arrives after the survivor's regroup timeout: the survivor raises
  InPlaceFallback, and torchrun's whole restart finishes the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from example_runs import finish
from harness import env, start_agent
from warm_pool import KEEPER_ENTRY, keeper, prestart_module

from steadytrain.testing import forkserver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
# The module on one worker, its keepers' warm process started as it begins (warm_pool).
warm_module = prestart_module(KEEPER_ENTRY)

WORKER = os.path.join(os.path.dirname(__file__), "inplace_worker.py")
STEPS, KILL_AT = 10, 7
# Live recovery alone for every fault, except ``late`` (after optimizer.step(): nothing is
# live), which keeps snapshots every 3 steps (0, 3, 6, 9) and rolls back to 6.
EVERY = {"late": 3}
RESUME = {"late": 6, "instep": KILL_AT + 1}


def start(
    out: str, kill_at: int, kill_rank: int = 1, *extra: str, world: int = 2
) -> subprocess.Popen | forkserver.ForkedProcess:
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"]
    cmd += ["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    entry, warm_env = keeper(WORKER)  # the keeper, forked from a warm process
    cmd += ["--monitor-interval=0.2", *entry, out]
    every = EVERY.get(extra[0] if extra else "once", 0)
    cmd += [str(STEPS), str(kill_at), str(every), str(kill_rank), *extra]
    # In-place recovery regroups on torchrun's shared store: the harness's
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 would turn it off (the keeper says so).
    e = env(**warm_env)
    e.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    return start_agent(cmd, e)


def records(out: str, rank: int) -> list[dict]:
    with open(os.path.join(out, f"r{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_in_place(ref: str, run: str, log: str, victim: int, world: int, resume: int) -> None:
    assert f"rank {victim}: process" in log and "replacing it in place (1 of 3)" in log, log[-4000:]
    assert log.count("replacing it in place") == 1, log[-4000:]  # the victim alone
    for survivor in (r for r in range(world) if r != victim):
        check_survivor(run, records(run, survivor), resume)
    replaced = records(run, victim)
    assert {r["restart"] for r in replaced} == {"0"}, "torchrun's agent restarted the job"
    assert len({r["keeper"] for r in replaced}) == 1
    first, second = sorted({r["pid"] for r in replaced}, key=[r["pid"] for r in replaced].index)
    assert [r["step"] for r in replaced if r["pid"] == first] == list(range(KILL_AT))
    assert {r["incarnation"] for r in replaced if r["pid"] == second} == {1}
    # The replacement started at the agreed step: live 7, or the snapshot of 6.
    assert [r["step"] for r in replaced if r["pid"] == second] == list(range(resume, STEPS))
    for rank in range(world):  # every record of a step, the redone ones too, is the reference's
        want = {r["step"]: r["loss"] for r in records(ref, rank)}
        assert sorted(want) == list(range(STEPS))
        for r in records(run, rank):
            assert r["loss"] == want[r["step"]], (rank, r, want[r["step"]])


def check_survivor(run: str, kept: list[dict], resume: int) -> None:
    assert {r["restart"] for r in kept} == {"0"}, "torchrun's agent restarted the job"
    assert len({r["pid"] for r in kept}) == 1, "a survivor's training process was replaced"
    assert len({r["keeper"] for r in kept}) == 1
    # The survivor did the failed step again (live), redid it from its snapshot at 6, or
    # (``instep``) finished 7 and did 8 again.
    assert [r["step"] for r in kept] == [*range(max(KILL_AT, resume)), *range(resume, STEPS)]


def final(run: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(run, "final.pt"))


# 2 ranks: each rank killed in turn (rank 1 inside its optimizer step: live at the next
# step; rank 0 after its optimizer step, before a collective: the snapshot path; rank 0's
# replacement takes the replicated state from rank 1), and rank 1 stopped (SIGSTOP:
# the hang watchdog and the reaper make it a killed one); 3 ranks: the middle one killed,
# with two survivors in the regroup. (A live rank 0's replacement: test_run_inplace.py.)
@pytest.mark.parametrize(
    "world,faults",
    [(2, ((1, "instep"), (0, "late"), (1, "stop"))), (3, ((1, "once"),))],
    ids=["2-ranks", "3-ranks"],
)
def test_a_lost_rank_is_replaced_in_place_and_the_run_stays_exact(
    tmp_path, world: int, faults: tuple[tuple[int, str], ...]
) -> None:
    ref = str(tmp_path / "ref")
    runs = {(v, mode): str(tmp_path / f"{mode}{v}") for v, mode in faults}
    procs = [start(ref, 0, world=world)]
    procs += [start(run, KILL_AT, v, mode, world=world) for (v, mode), run in runs.items()]
    logs = [finish(p) for p in procs]

    expected = final(ref)
    for ((victim, mode), run), log in zip(runs.items(), logs[1:], strict=True):
        check_in_place(ref, run, log, victim, world, RESUME.get(mode, KILL_AT))
        assert all(torch.equal(final(run)[k], expected[k]) for k in expected), run
        if mode == "stop":  # decided hung by the others, reaped, not one of them exiting
            with open(os.path.join(run, "run", "hangs", "attempt-0", "decision-0.json")) as f:
                assert json.load(f)["stuck_ranks"] == [victim], log[-4000:]
            assert f"[reaper] rank {victim}" in log and "(stopped); sent SIGKILL" in log
            assert "rank 0: not exiting: in-place recovery replaces rank(s) [1]" in log
            assert "so the job restarts" not in log


def test_a_repeating_fault_or_a_late_replacement_falls_back_to_the_whole_restart(
    tmp_path,
) -> None:
    repeat, slow = str(tmp_path / "repeat"), str(tmp_path / "slow")
    procs = [start(repeat, KILL_AT, 1, "repeat"), start(slow, KILL_AT, 1, "slow")]
    logs = [finish(p) for p in procs]

    # A replacement that dies before completing a step: a repeating fault.
    assert "whole restart: the training process was killed by SIGKILL before it" in logs[0]
    # A regroup that times out (the replacement comes too late): the survivor gives up.
    assert "rank 0: could not form a new process group in place within 3 s" in logs[1]
    for run, log in ((repeat, logs[0]), (slow, logs[1])):
        for rank in (0, 1):  # torchrun's attempt 1 trained every step, from a fresh start
            recs = records(run, rank)
            assert {r["restart"] for r in recs} == {"0", "1"}, log[-4000:]
            assert [r["step"] for r in recs if r["restart"] == "1"] == list(range(STEPS))
    # Both fallbacks' fresh attempts end with the same weights: nothing of the failed
    # attempt (a half-restored state, a late replacement) leaked into either.
    assert all(torch.equal(final(repeat)[k], final(slow)[k]) for k in final(repeat))
