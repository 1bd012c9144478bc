"""Helpers for the training end-to-end tests: a small dataset, torchrun, traces.

Every test runs the real ``steadytrain train`` under the real ``torchrun`` (``python -m
torch.distributed.run``) on CPU with gloo. The model is tiny (2 layers, d=64, seq 64) so a
step takes milliseconds and a run's cost is mostly process start-up.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
import sysconfig
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from steadytrain.testing import forkserver
from steadytrain.testing.incidents.common import TINY_SETTINGS, read_trace  # noqa: F401

if TYPE_CHECKING:
    from torch.distributed import TCPStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
PY = sys.executable

# Tiny and fast: the comparison is about bits and sample ids, not about learning. The
# incident replays share the same settings (steadytrain.testing.incidents.common); MLflow
# is off there too (opening its store costs rank 0 seconds of CPU per run on 2 busy cores;
# tests of MLflow itself turn it back on).
BASE_SETTINGS = [*TINY_SETTINGS, "checkpoint.every_steps=4"]


def rendezvous_store() -> TCPStore:
    """A c10d rendezvous store for several torchrun agents, hosted by the test on a port
    the kernel picks as it binds (port 0). Pass its ``.port`` to every agent with
    ``is_host=false``: no agent binds a port chosen in advance, which another process could
    take in between. Keep the object alive until the agents are done."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=300),
    )


def make_dataset(dest: str, max_bytes: int = 400_000) -> str:
    """A bytes-tokenized dataset of real text (stdlib sources, fixed order), 2+ shards."""
    import numpy as np

    from steadytrain.data.ingest.writer import DatasetWriter

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")))
    files += sorted(glob.glob(os.path.join(stdlib, "email", "*.py")))
    total = 0
    with DatasetWriter(
        dest,
        vocab_size=257,
        eos_id=256,
        tokenizer={"type": "bytes", "vocab_size": 257, "eos_id": 256},
        shard_tokens=100_000,
    ) as w:
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            doc = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
            w.add_document(np.append(doc, 256))
            total += doc.size + 1
            if total >= max_bytes:
                break
    return dest


def torchrun_cmd(
    nproc: int,
    settings: list[str],
    *,
    max_restarts: int = 0,
    port: int | None = None,
    nnodes: str = "1",
    rdzv_conf: str = "",
    run_id: str = "steadytest",
) -> list[str]:
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        # Port 0 (what --standalone uses): a single agent hosts the rendezvous store on a
        # port the kernel picks while binding. Several agents share `rendezvous_store()`.
        f"--rdzv-endpoint=127.0.0.1:{port or 0}",
        f"--rdzv-id={run_id}",
        "--monitor-interval=0.2",
    ]
    if rdzv_conf:
        cmd.append(f"--rdzv-conf={rdzv_conf}")
    cmd += ["-m", "steadytrain.cli", "train", "demo"]
    for s in settings:
        cmd += ["--set", s]
    return cmd


def env(faults: str = "", **extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["STEADYTRAIN_FAULTS"] = faults
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    # torchrun's agent-shared TCPStore hands restarted workers stale gloo addresses
    # (pytorch/pytorch#135712): every attempt gets a fresh store instead.
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    e.update(extra)
    return e


def kill_tree(proc: subprocess.Popen | forkserver.ForkedProcess) -> None:
    """Kill a launcher and every process under it (torchrun starts workers in new sessions)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for p in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def start_agent(
    cmd: list[str], env: dict[str, str], cwd: str = REPO, **output: Any
) -> subprocess.Popen | forkserver.ForkedProcess:
    """torchrun's agent (``cmd``: ``python -m torch.distributed.run ...``) forked from the
    fork server: its own start-up and hash seed are nothing a test checks, and the ranks it
    starts stay fresh interpreters (the agent's ``subprocess``). ``output``: ``merge``,
    ``stdout``, ``stderr`` of ``forkserver.popen`` (default: one pipe for both)."""
    return forkserver.popen(cmd, env=env, cwd=cwd, **output)


def start_torchrun(
    nproc: int, settings: list[str], *, faults: str = "", max_restarts: int = 0
) -> subprocess.Popen | forkserver.ForkedProcess:
    """``steadytrain train`` under torchrun in the background (``wait_torchrun`` it)."""
    cmd = torchrun_cmd(nproc, BASE_SETTINGS + settings, max_restarts=max_restarts)
    return start_agent(cmd, env(faults), merge=False)


def run_torchrun(
    nproc: int,
    settings: list[str],
    *,
    faults: str = "",
    max_restarts: int = 0,
    timeout: float = 180,
    check: bool = True,
) -> subprocess.CompletedProcess:
    proc = start_torchrun(nproc, settings, faults=faults, max_restarts=max_restarts)
    return wait_torchrun(proc, timeout=timeout, check=check)


def wait_torchrun(
    proc: subprocess.Popen | forkserver.ForkedProcess, *, timeout: float = 180, check: bool = True
) -> subprocess.CompletedProcess:
    cmd = proc.args
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun timed out\n{out[-4000:]}\n{err[-8000:]}") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun exited {proc.returncode}\n--- stdout\n{out[-6000:]}"
            f"\n--- stderr\n{err[-8000:]}"
        )
    return done


def effective(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per step, what the finished run trained on: the newest attempt's records of that step.

    Returns {step: {"loss": float, "sample_ids": [ids of rank 0, then rank 1, ...],
    "world": int}}. A step redone after a crash counts once, from the attempt that went on
    (``attempt_id``: the start time rank 0 chose for that attempt, shared by all ranks).
    """
    by_step: dict[int, dict[float, dict[int, dict[str, Any]]]] = defaultdict(dict)
    for r in records:
        by_step[r["step"]].setdefault(r["attempt_id"], {})[r["rank"]] = r
    out = {}
    for step, attempts in sorted(by_step.items()):
        recs = attempts[max(attempts)]
        ranks = sorted(recs)
        world = recs[ranks[0]]["world"]
        assert ranks == list(range(world)), f"step {step}: ranks {ranks} of a world of {world}"
        ids = [i for rk in ranks for i in recs[rk]["sample_ids"]]
        out[step] = {"loss": recs[0]["loss"], "sample_ids": ids, "world": world}
    return out


def ledger(run_dir: str) -> list[dict[str, Any]]:
    from steadytrain.monitor.ledger import read_ledger

    return read_ledger(os.path.join(run_dir, "ledger.jsonl"))


def final(run_dir: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, "final.json")) as f:
        return json.load(f)


def assert_same_run(run_dir: str, ref_dir: str, steps: int, global_batch: int) -> dict:
    """Every step's samples and loss (bit for bit), and the final weights, equal the reference
    run's; no sample is read twice. Returns the reference's ``effective`` records."""
    ref, got = effective(read_trace(ref_dir)), effective(read_trace(run_dir))
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], f"step {step} samples"
        assert got[step]["loss"] == ref[step]["loss"], f"step {step} loss"
    all_ids = [i for s in range(1, steps + 1) for i in got[s]["sample_ids"]]
    assert len(all_ids) == len(set(all_ids)) == steps * global_batch
    assert final(run_dir)["weights"] == final(ref_dir)["weights"]
    assert final(run_dir)["step"] == steps
    return ref
