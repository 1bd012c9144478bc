"""``Run`` with in-place recovery on under Slurm without torchrun: each rank a separate
``python -m steadytrain.inplace.keeper`` process with the variables ``srun`` gives its tasks
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the node list...), no torchrun and
no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``: the keeper derives them, and rank 0's keeper
hosts the store (``steadytrain.inplace.slurm``). 2 gloo ranks, DDP,
``inplace_run_worker.py`` uninterrupted and with one rank's training process SIGKILLed
mid-step (between its forward and its backward, the other rank blocked in DDP's
all-reduce): rank 1, and rank 0 (whose keeper hosts the store, so the store lives on).

The killed run, as ``test_run_inplace.py`` checks under torchrun:

- every keeper (the task srun watches) ends with status 0 and the survivor's training
  process keeps its pid; only the victim's process is new, forked by its keeper;
- recovers from the survivor's live state at the start of the failed step 7;
- has one ``inplace_recovery`` record: path ``in_place``, the victim lost at step 7,
  resumed at step 7; the goodput ledger books the gap as a restart;
- is exact: every step's loss on each rank and the final weights equal the uninterrupted
  run's bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from example_runs import assert_same_as_uninterrupted, finish
from harness import REPO, env
from warm_pool import keeper

from steadytrain.report.build import build_report
from steadytrain.testing import forkserver
from steadytrain.testing.ports import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "inplace_run_worker.py")
STEPS, KILL_AT, WORLD = 12, 7, 2
# What torchrun sets and srun does not: none of it may reach the keeper from the test's env.
NOT_UNDER_SRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def srun(
    run_dir: str, kill_at: int, kill_rank: int, **extra: str
) -> list[forkserver.ForkedProcess]:
    """What ``srun --ntasks=2 python -m steadytrain.inplace.keeper WORKER ARGS`` starts on
    one node: one keeper per task, each with its task's variables."""
    (port,) = free_ports(1)
    entry, warm_env = keeper(WORKER)
    tasks = []
    for rank in range(WORLD):
        e = env(**warm_env)
        for name in (*NOT_UNDER_SRUN, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
            e.pop(name, None)
        assert not any(k.startswith("TORCHELASTIC_") for k in e), "the test runs under torchrun"
        e.update(
            SLURM_JOB_ID="4242",
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_NTASKS=str(WORLD),
            SLURM_STEP_NUM_TASKS=str(WORLD),
            SLURM_JOB_NODELIST="localhost",
            SLURM_STEP_NODELIST="localhost",
            SLURM_TASKS_PER_NODE=str(WORLD),
            SLURM_STEP_TASKS_PER_NODE=str(WORLD),
            MASTER_PORT=str(port),  # srun's jobs share this machine: a free port each
            **extra,
        )
        cmd = [sys.executable, *entry, run_dir, str(STEPS), str(kill_at), str(kill_rank)]
        tasks.append(forkserver.popen(cmd, env=e, cwd=REPO))
    return tasks


def lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    ref = str(tmp_path_factory.mktemp("srun-ref"))
    for task in srun(ref, 0, 0):
        finish(task)
    return ref


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-store-host"])
def test_srun_recovers_a_sigkilled_rank_in_place_and_stays_exact(
    tmp_path, reference: str, victim: int
) -> None:
    killed = str(tmp_path / "killed")
    os.makedirs(killed)
    logs = [finish(task) for task in srun(killed, KILL_AT, victim)]  # every keeper exits 0

    log = logs[victim]
    assert f"rank {victim}: process" in log and "replacing it in place (1 of 3)" in log, log[-4000:]
    assert "in-place recovery is off" not in "".join(logs), logs
    replaced = lines(os.path.join(killed, f"r{victim}.jsonl"))
    kept = lines(os.path.join(killed, f"r{1 - victim}.jsonl"))
    assert {r["restart"] for r in kept + replaced} == {"none"}  # no torchrun anywhere
    assert len({r["pid"] for r in kept}) == 1, "the survivor's process was replaced"
    assert [r["step"] for r in kept] == list(range(STEPS))  # step 7 once: it failed, then ran
    assert [r["step"] for r in replaced if r["incarnation"] == 1] == list(range(KILL_AT, STEPS))
    assert len({r["pid"] for r in replaced if r["incarnation"] == 1}) == 1
    assert_same_as_uninterrupted(reference, killed, STEPS, WORLD)

    ledger = lines(os.path.join(killed, "ledger.jsonl"))
    recs = [r for r in ledger if r["type"] == "inplace_recovery"]
    assert len(recs) == 1, recs
    rec = recs[0]
    assert (rec["path"], rec["failed_ranks"], rec["from_step"], rec["step"]) == (
        "in_place",
        [victim],
        KILL_AT,
        KILL_AT,
    )
    assert set(rec["phases"]) >= {"detection_s", "regroup_s", "restore_s", "redo_s"}
    assert "resumed from the survivors' live state at the start of step 7" in rec["why"], rec
    starts = [r for r in ledger if r["type"] == "job_start"]
    assert [s["restored_step"] for s in starts] == [0, KILL_AT]  # the gap is a restart's
    report = build_report(killed)
    assert [(r["path"], r["failed_ranks"]) for r in report["recoveries"]] == [
        ("in_place", [victim])
    ]
    assert build_report(reference)["recoveries"] == []


def test_the_store_hosts_death_ends_every_rank_for_the_whole_restart(tmp_path) -> None:
    """Rank 0's keeper (the store's host) SIGKILLed in step 7 (its training process dies
    with it): nothing can be recovered in place. The survivor's regroup cannot reach the
    store; it exits with ``InPlaceFallback`` within its regroup timeout, its keeper passes
    the failure on (srun's ``--kill-on-bad-exit=1`` would end the step already at rank 0's
    death), and no rank trains on or hangs: Slurm's requeue is the whole restart."""
    run_dir = str(tmp_path / "host-lost")
    os.makedirs(run_dir)
    tasks = srun(run_dir, KILL_AT, 0, INPLACE_KILL_KEEPER="1", INPLACE_REGROUP_TIMEOUT_S="5")
    outs = [task.communicate(timeout=120)[0] for task in tasks]
    assert tasks[0].returncode == -signal.SIGKILL, outs[0][-4000:]
    assert tasks[1].returncode == 1, outs[1][-4000:]
    assert "could not form a new process group in place within 5 s" in outs[1], outs[1][-4000:]
    assert "rank 1: process" in outs[1] and "; whole restart: " in outs[1], outs[1][-4000:]
    assert "replacing it in place" not in "".join(outs)
    for rank in range(WORLD):  # no step after the one the keeper died in
        assert max(r["step"] for r in lines(os.path.join(run_dir, f"r{rank}.jsonl"))) < KILL_AT
    assert not os.path.exists(os.path.join(run_dir, "final.pt"))
