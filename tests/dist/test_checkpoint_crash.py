"""Crash matrix: SIGKILL a saving rank at random moments, then resume must pick the newest
committed checkpoint and never a torn one.

A forked child (cheap: torch is already imported) joins a 1-rank gloo group, fills every
parameter with the step number and saves at every step, so a checkpoint's content names the
step it came from. The parent kills it after a seeded random delay, which lands in staging,
the DCP write, the upload (remote runs) or the commit, and then checks what a restart sees.
58 kills in total over sync / thread / process and a remote (file://) destination.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import time

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.commit import verify_local
from steadytrain.checkpoint.remote import Root, discover

pytestmark = pytest.mark.dist

# (mode, remote?, kills, delay range in s); process mode pays ~2-3 s to start DCP's daemon.
MATRIX = [
    ("sync", False, 16, (0.05, 0.5)),
    ("thread", False, 16, (0.05, 0.5)),
    ("thread", True, 14, (0.05, 0.6)),
    ("process", False, 4, (1.5, 3.5)),
    ("process", True, 4, (1.5, 3.5)),
]


class Cursor:
    def __init__(self) -> None:
        self.cursor = 0

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor = sd["cursor"]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))  # ~1 MiB of state


def _child(directory: str, mode: str, remote: str | None, log: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)  # the host has 2 busy cores: no OpenMP pool wake-ups
    dist.init_process_group("gloo", rank=0, world_size=1)
    model, loader = _model(), Cursor()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def on_event(e: dict) -> None:
        if e["type"] == "checkpoint" and e["ok"]:
            with open(log, "a") as f:
                f.write(f"{e['step']}\n")

    ckpt = Checkpointer(
        directory, every_steps=1, keep_last=2, async_mode=mode, remote=remote, on_event=on_event
    )
    start = ckpt.restore_latest({"model": model, "optim": optim, "loader": loader})
    for step in range(start + 1, start + 10_000):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        loader.cursor = step
        ckpt.maybe_save(step, {"model": model, "optim": optim, "loader": loader})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    for mode, use_remote, n, (lo, hi) in MATRIX:
        base = tmp_path / f"{mode}-{int(use_remote)}"
        local = str(base / "local")
        remote = f"file://{base}/remote" if use_remote else None
        log = str(base / "ok.log")
        os.makedirs(base, exist_ok=True)
        root = Root(remote or local)
        for _ in range(n):
            pid = os.fork()
            if pid == 0:  # the child never returns into pytest
                try:
                    _child(local, mode, remote, log)
                except BaseException:
                    import traceback

                    with open(f"{log}.err", "a") as f:
                        f.write(traceback.format_exc())
                finally:
                    os._exit(0)
            time.sleep(rng.uniform(lo, hi))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            kills += 1
            phases[_phase(root)] += 1
            _check_resume(root, local, remote, log)
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
    model, loader = _model(), Cursor()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(local, async_mode="sync", remote=remote)
    step = ckpt.restore_latest({"model": model, "optim": optim, "loader": loader})
    assert step == (committed[0].step if committed else 0), "resume must pick the newest commit"
    if step:  # content proves it is not torn: every tensor and the loader say `step`
        assert loader.cursor == step
        for p in model.parameters():
            assert torch.all(p == float(step)), f"torn checkpoint at step {step}"
