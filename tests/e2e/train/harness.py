"""Helpers for the training end-to-end tests: a small dataset, torchrun, traces.

Every test runs the real ``steadytrain train`` under the real ``torchrun`` (``python -m
torch.distributed.run``) on CPU with gloo. The model is tiny (2 layers, d=64, seq 64) so a
step takes milliseconds and a run's cost is mostly process start-up: so the ranks are
forked from a warm process (``steadytrain warm``, ``warm_ranks``) unless a test asks for
``fresh=True`` (the exactness guard, ``test_train_exact_resume.py``, and the shared
baseline: fresh ranks draw their own hash seeds) or ``STEADYTRAIN_TEST_FRESH=1`` is set.
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


# How long a run waits for the warm process to listen before its ranks start fresh (the
# warm process was started with the first training test, ``prestart_warm``). A run that
# starts fresh pays ~3.3 s of CPU per rank on top of the preload already under way: in the
# suite (4 workers on 2 cores) a worker's first training runs started fresh with 5 s, and
# the waiting costs no CPU. The hang tests (whole-test timeouts of 120 and 180 s) must not
# spend their own time on a preload that takes minutes at load 30: they wait HANG_WARM_WAIT_S.
WARM_WAIT_S = 60.0
HANG_WARM_WAIT_S = 5.0


def _warm_pool() -> Any:
    """``tests/integrations/warm_pool.py`` (it imports this module: not at the top)."""
    integrations = os.path.join(REPO, "tests", "integrations")
    if integrations not in sys.path:
        sys.path.insert(0, integrations)
    import warm_pool

    return warm_pool


def prestart_warm() -> None:
    """Start the warm process for the ranks now, without waiting (``warm_pool.prestart``):
    its preload overlaps the first test's set-up."""
    from steadytrain.train.demo_run import train_entry

    _warm_pool().prestart(train_entry())


def warm_ranks(
    fresh: bool = False, wait_s: float = WARM_WAIT_S
) -> tuple[list[str], dict[str, str]]:
    """What torchrun starts for each rank of ``steadytrain train``, and the environment the
    agent needs for it: ``-m steadytrain.warm.enter`` on the CLI's preloading entry file
    (``steadytrain/inplace/train_entry.py``) with the socket of this test process's warm
    process for it (``tests/integrations/warm_pool.py``); ``-m steadytrain.cli`` (a fresh
    interpreter per rank) when ``fresh``, with ``STEADYTRAIN_TEST_FRESH=1``, or while the
    warm process is not listening within ``wait_s``."""
    if fresh:
        return ["-m", "steadytrain.cli"], {}
    from steadytrain.train.demo_run import train_entry

    args, warm_env = _warm_pool().launch(train_entry(), wait_s=wait_s)
    return (args if warm_env else ["-m", "steadytrain.cli"]), warm_env


def warm_workers_cpu(sock: str) -> float:
    """CPU seconds of the workers the warm process at ``sock`` (this test process's child)
    forked and reaped so far: what grows when ranks really were forked there."""
    import psutil

    for p in psutil.Process().children():
        if sock in p.cmdline():
            t = p.cpu_times()
            return t.children_user + t.children_system
    raise AssertionError(f"no warm process of this test process serves {sock}")


def torchrun_cmd(
    nproc: int,
    settings: list[str],
    *,
    max_restarts: int = 0,
    port: int | None = None,
    nnodes: str = "1",
    rdzv_conf: str = "",
    run_id: str = "steadytest",
    entry: list[str] | None = None,
) -> list[str]:
    """``entry``: what runs the CLI (``warm_ranks()``'s first item; default a fresh
    ``-m steadytrain.cli``)."""
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
    cmd += [*(entry or ["-m", "steadytrain.cli"]), "train", "demo"]
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
    fork server: its own start-up and hash seed are nothing a test checks; the processes it
    starts are its own children (``subprocess``): the ranks, or their warm entries. ``output``: ``merge``,
    ``stdout``, ``stderr`` of ``forkserver.popen`` (default: one pipe for both)."""
    return forkserver.popen(cmd, env=env, cwd=cwd, **output)


def start_torchrun(
    nproc: int,
    settings: list[str],
    *,
    faults: str = "",
    max_restarts: int = 0,
    fresh: bool = False,
    warm_wait_s: float = WARM_WAIT_S,
) -> subprocess.Popen | forkserver.ForkedProcess:
    """``steadytrain train`` under torchrun in the background (``wait_torchrun`` it); its
    ranks forked from the warm process unless ``fresh`` (``warm_ranks``, ``warm_wait_s``)."""
    entry, warm_env = warm_ranks(fresh, warm_wait_s)
    cmd = torchrun_cmd(nproc, BASE_SETTINGS + settings, max_restarts=max_restarts, entry=entry)
    return start_agent(cmd, env(faults, **warm_env), merge=False)


def run_torchrun(
    nproc: int,
    settings: list[str],
    *,
    faults: str = "",
    max_restarts: int = 0,
    timeout: float = 180,
    check: bool = True,
    fresh: bool = False,
    warm_wait_s: float = WARM_WAIT_S,
) -> subprocess.CompletedProcess:
    proc = start_torchrun(
        nproc,
        settings,
        faults=faults,
        max_restarts=max_restarts,
        fresh=fresh,
        warm_wait_s=warm_wait_s,
    )
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
