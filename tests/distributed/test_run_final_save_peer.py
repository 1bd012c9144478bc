"""A peer lost during the final save is a crash, not a clean end (``run_final_save.py``).

Two real processes on a gloo group run 3 steps under ``steadytrain.Run``; rank 1 is
SIGKILLed after the last step, so rank 0's final save fails on the broken group. Rank 0
must exit with an error naming the lost rank and record a crash in the ledger (its
launcher then restarts the job, which restores and saves again), not exit 0 as "finished"
(which left a multi-node torchrun agent waiting 300 s in its exit barrier). With both ranks
alive the same job ends "finished" and the last step is committed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from steadytrain.checkpoint.inspect import list_checkpoints
from steadytrain.monitor.ledger import read_ledger
from steadytrain.testing import forkserver

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORKER = os.path.join(os.path.dirname(__file__), "final_save_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(run_dir: str, *flags: str) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    env.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    # Forked from the fork server (stdout and stderr in one pipe): nothing here is about
    # start-up, and a fresh interpreter per rank costs seconds of CPU.
    procs = [
        forkserver.popen([sys.executable, WORKER, run_dir, *flags],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(2)
    ]  # fmt: skip
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=150)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


def _ends(run_dir: str) -> list[str]:
    records = read_ledger(os.path.join(run_dir, "ledger.jsonl"))
    return [r["reason"] for r in records if r["type"] == "job_end"]


def test_a_peer_lost_in_the_final_save_makes_the_survivor_exit_as_a_crash(tmp_path):
    run_dir = str(tmp_path / "run")
    rank0, rank1 = _job(run_dir, "--peer-dies")
    assert rank1.returncode == -9, rank1.stdout[-3000:]
    assert rank0.returncode == 1, rank0.stdout[-3000:]
    assert "EXIT CheckpointError" in rank0.stdout and "a rank of the job is gone" in rank0.stdout
    assert _ends(run_dir) and "finished" not in _ends(run_dir), _ends(run_dir)


def test_with_every_rank_alive_the_job_ends_finished_and_committed(tmp_path):
    run_dir = str(tmp_path / "run")
    for p in _job(run_dir):
        assert p.returncode == 0 and "EXIT ok" in p.stdout, p.stdout[-3000:]
    assert _ends(run_dir) == ["finished"]
    rows = list_checkpoints(os.path.join(run_dir, "checkpoints"))
    assert [r["step"] for r in rows if r["state"] == "committed"] == [3]
