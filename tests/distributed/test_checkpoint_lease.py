"""One live writer per checkpoint root, with real jobs (separate processes) on one directory.

Issue 12 item 1: two jobs saving into one directory picked the same ``step-N`` names, wrote
the same file names, and produced checkpoints holding one job's weight and the other's bias
that still verified. Each job here fills every tensor of step ``s`` with ``BASE + s``
(``checkpoint/lease_worker.py``), so a mixed checkpoint shows two values.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from steadytrain.checkpoint.inspect import list_checkpoints
from steadytrain.checkpoint.raw_records import ShardReader
from steadytrain.testing import forkserver

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
WORKER = os.path.join(HERE, "lease_worker.py")

pytestmark = pytest.mark.dist


def _start(root, base: int, *args: str, job: str | None) -> forkserver.ForkedProcess:
    """A job: one process, forked from a server that imported torch once."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    if job is not None:
        env["TORCHELASTIC_RUN_ID"] = job
    env["OMP_NUM_THREADS"] = "1"
    return forkserver.popen(
        [sys.executable, WORKER, str(root), "--base", str(base), *args], env=env
    )


def _finish(proc: forkserver.ForkedProcess, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _wait_ready(proc: forkserver.ForkedProcess, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}:\n{proc.communicate()[0]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"worker not ready:\n{proc.communicate()[0]}")
        time.sleep(0.05)


def _kill(proc: forkserver.ForkedProcess) -> None:
    proc.kill()
    proc.communicate()


def _values(root) -> dict[str, float]:
    """{checkpoint name: the one value all its tensors hold}; every committed checkpoint
    must verify and hold a single job's values (weight and bias of the same save)."""
    out = {}
    for row in list_checkpoints(str(root)):
        if row["state"] != "committed":
            continue
        assert row["verifies"], row
        sd = {"model": {"weight": torch.zeros(64, 64), "bias": torch.zeros(64)}}
        dcp.load(sd, storage_reader=ShardReader(row["path"]), no_dist=True)
        values = torch.cat([sd["model"]["weight"].flatten(), sd["model"]["bias"]]).unique()
        assert values.numel() == 1, f"{row['name']} mixes two jobs: {values.tolist()}"
        out[row["name"]] = float(values[0])
    return out


@pytest.mark.timeout(300)
def test_second_live_job_is_refused_by_name_and_a_killed_jobs_restart_is_not(tmp_path):
    root = tmp_path / "ckpts"
    a = _start(root, 1000, "--steps", "2", "--hold", "--ready", str(tmp_path / "a"), job="job-a")
    _wait_ready(a, tmp_path / "a")
    rc, out = _finish(_start(root, 2000, "--steps", "2", job="job-b"))
    assert rc == 3, out  # refused at its first save: it wrote nothing
    assert "another live job" in out and str(root) in out, out
    assert f"pid {a.pid}" in out and "job torchelastic:job-a" in out, out
    assert "Fix: stop that job" in out, out
    _kill(a)  # SIGKILL: the lease stays behind, unreleased
    rc, out = _finish(_start(root, 3000, "--steps", "2", job="job-a"))
    assert rc == 0 and "done" in out, out  # same job identity: a restart, not blocked
    # Without any job identity: a dead pid on this host frees the lease too.
    c = _start(root, 4000, "--steps", "1", "--hold", "--ready", str(tmp_path / "c"), job=None)
    _wait_ready(c, tmp_path / "c")
    _kill(c)
    rc, out = _finish(_start(root, 5000, "--steps", "1", job=None))
    assert rc == 0 and "done" in out, out
    values = _values(root)
    assert 5001.0 in values.values() and not [v for v in values.values() if 2000 < v < 3000]


@pytest.mark.timeout(300)
def test_two_jobs_started_together_one_is_refused_and_nothing_is_mixed(tmp_path):
    root = tmp_path / "ckpts"
    ready = {base: tmp_path / f"ready-{base}" for base in (1000, 2000)}
    jobs = {
        base: _start(root, base, "--steps", "4", "--hold", "--ready", str(ready[base]), job=None)
        for base in (1000, 2000)
    }
    deadline = time.monotonic() + 180
    # Each job ends up refused (exit 3, nothing written) or holding the root after 4 saves.
    while not all(p.poll() is not None or ready[b].exists() for b, p in jobs.items()):
        assert time.monotonic() < deadline, "the jobs did not settle"
        time.sleep(0.05)
    refused = [b for b, p in jobs.items() if p.poll() is not None]
    outs = {}
    for base, proc in jobs.items():
        if proc.poll() is None:
            proc.kill()
        outs[base] = (proc.wait(), proc.communicate()[0])
    assert len(refused) == 1, outs  # the code before the lease let both write
    assert outs[refused[0]][0] == 3 and "another live job" in outs[refused[0]][1], outs
    winner = 3000 - refused[0]
    values = _values(root)
    assert sorted(values.values()) == [winner + s for s in (2, 3, 4)], values  # keep_last=3


@pytest.mark.timeout(300)
def test_a_paused_job_loses_its_lease_and_stops_without_touching_the_new_one(tmp_path):
    root = tmp_path / "ckpts"
    a = _start(root, 1000, "--forever", "--timeout", "1", "--ready", str(tmp_path / "a"), job="a")
    _wait_ready(a, tmp_path / "a")
    os.kill(a.pid, signal.SIGSTOP)  # alive but silent: only its heartbeat ages
    try:
        _wait_stale(root / ".writer-lease", older_than=1.5)
        rc, out = _finish(_start(root, 2000, "--steps", "3", "--timeout", "1", job="b"))
        assert rc == 0 and "done" in out, out
    finally:
        os.kill(a.pid, signal.SIGCONT)
    rc, out = _finish(a)
    assert rc == 4, out  # it noticed, and stopped saving instead of writing beside b
    assert "lost the checkpoint writer lease" in out and "job torchelastic:b" in out, out
    values = _values(root)
    assert {2001.0, 2002.0, 2003.0} <= set(values.values()), values  # b's saves all kept


def _wait_stale(lease_dir, older_than: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        gens = sorted(p for p in lease_dir.iterdir() if p.name.endswith(".json"))
        beat = json.loads(gens[-1].read_text())["heartbeat"]
        if time.time() - beat > older_than:
            return
        assert time.monotonic() < deadline, "the paused job's heartbeat never aged"
        time.sleep(0.1)
