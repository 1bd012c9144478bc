"""Crash matrix: SIGKILL a saving rank at random moments, then resume must pick the newest
committed checkpoint and never a torn one.

A child joins a 1-rank gloo group, fills every parameter with the step number and saves at
every step, so a checkpoint's content names the step it came from. Children are forked by a
single-threaded zygote that imported torch once (``checkpoint/crash_zygote.py``), never by
this multi-threaded pytest process. Once a child reports it is ready, the test kills it
after a seeded random delay, which lands in staging, the DCP write, the upload (remote
runs) or the commit, and then checks what a restart sees. 54 kills in total over sync /
thread / process and a remote (file://) destination.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.commit import verify_local
from steadytrain.checkpoint.remote import Root, discover

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)

from crash_zygote import Cursor, make_model  # noqa: E402

pytestmark = pytest.mark.dist

# (mode, remote?, kills, delay range in s after the child is ready); process mode pays
# ~2-3 s at its first save to start DCP's daemon.
MATRIX = [
    ("sync", False, 16, (0.05, 0.5)),
    ("thread", False, 16, (0.05, 0.5)),
    ("thread", True, 14, (0.05, 0.6)),
    ("process", False, 4, (1.5, 3.5)),
    ("process", True, 4, (1.5, 3.5)),
]


class Zygote:
    """The forking helper process (see crash_zygote.py for the protocol)."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "crash_zygote.py")],
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # single-threaded when it forks
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )

    def _send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _wait_for(self, key: str, pid: int | None = None) -> int:
        while line := self.proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not ours (a library printing to stdout)
            if isinstance(msg, dict) and key in msg and pid in (None, msg[key]):
                return msg[key]
        raise AssertionError(f"the zygote exited ({self.proc.wait()}); see {self.log_path}")

    def run(self, **job: str | None) -> int:
        """Fork a saving job; return its pid once it is ready to be killed."""
        self._send({"run": job})
        return self._wait_for("ready")

    def reap(self, pid: int) -> None:
        self._send({"reap": pid})
        self._wait_for("reaped", pid)

    def close(self) -> None:
        self.proc.stdin.close()  # end of input: the zygote's loop ends
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _phase(root: Root) -> str:
    """Where the kill landed, judged from the newest directory it left behind."""
    infos = discover(root)
    if not infos or infos[0].committed:
        return "staging / between saves"
    names = set(os.listdir(root.path(infos[0].name))) if root.is_local else set()
    if ".metadata" in names:
        return "uploading/committing"
    return "writing"


@pytest.mark.timeout(300)
def test_kill_matrix(tmp_path):
    rng = random.Random(20261129)
    phases: collections.Counter = collections.Counter()
    kills = 0
    zygote = Zygote(str(tmp_path / "zygote.log"))
    try:
        for mode, use_remote, n, (lo, hi) in MATRIX:
            base = tmp_path / f"{mode}-{int(use_remote)}"
            local = str(base / "local")
            remote = f"file://{base}/remote" if use_remote else None
            log = str(base / "ok.log")
            os.makedirs(base, exist_ok=True)
            root = Root(remote or local)
            for _ in range(n):
                pid = zygote.run(directory=local, mode=mode, remote=remote, log=log)
                time.sleep(rng.uniform(lo, hi))  # the random moment of the crash
                os.kill(pid, signal.SIGKILL)
                zygote.reap(pid)
                kills += 1
                phases[_phase(root)] += 1
                _check_resume(root, local, remote, log)
    finally:
        zygote.close()
    errs = [p.read_text() for p in tmp_path.glob("*/ok.log.err")]
    assert not errs, errs[0]
    print(f"{kills} kills, landed in: {dict(phases)}")
    assert kills >= 50
    assert phases["writing"] > 0


def _check_resume(root: Root, local: str, remote: str | None, log: str) -> None:
    committed = [i for i in discover(root) if i.committed]
    reported = [int(s) for s in open(log).read().split()] if os.path.exists(log) else []
    if reported:  # nothing the job was told is durable may disappear
        assert committed and committed[0].step >= max(reported)
    if committed and root.is_local:
        verify_local(root.path(committed[0].name), committed[0].manifest)
    model, loader = make_model(), Cursor()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(local, async_mode="sync", remote=remote)
    step = ckpt.restore_latest({"model": model, "optim": optim, "loader": loader})
    assert step == (committed[0].step if committed else 0), "resume must pick the newest commit"
    if step:  # content proves it is not torn: every tensor and the loader say `step`
        assert loader.cursor == step
        for p in model.parameters():
            assert torch.all(p == float(step)), f"torn checkpoint at step {step}"
