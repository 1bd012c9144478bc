"""Launch ranks as if on several nodes: each rank gets its node's name and memory directory.

Like ``launch.py`` (the rendezvous store is hosted here, port 0), plus per rank
``STEADYTRAIN_NODE`` and ``STEADYTRAIN_MEMORY_DIR``: ranks that share a node name share a
memory directory, and wiping that directory is what losing the node does to its RAM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from steadytrain.testing import forkserver


class Job:
    """``len(nodes)`` ranks of ``script``; ``nodes[r]`` is rank r's node."""

    def __init__(self, script: str, args: list[str], nodes: list[str], memdirs: dict[str, str]):
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        self.procs = []
        for rank, node in enumerate(nodes):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(len(nodes)),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self.store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                OMP_NUM_THREADS="1",
                STEADYTRAIN_NODE=node,
                STEADYTRAIN_MEMORY_DIR=memdirs[node],
            )
            self.procs.append(forkserver.popen([sys.executable, script, *args], env=env))

    def wait(self, timeout: float = 180, check: bool = True) -> list[str]:
        """Every rank's output; raise with all of it if a rank failed (``check``)."""
        outs, failed = [], False
        for p in self.procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                out, _ = p.communicate()
                failed = True
            outs.append(out)
            failed |= p.returncode != 0
        if failed and check:
            raise AssertionError(
                "\n".join(f"--- rank {i}\n{o[-4000:]}" for i, o in enumerate(outs))
            )
        return outs


def run(script: str, args: list[str], nodes: list[str], memdirs: dict[str, str]) -> list[str]:
    return Job(script, args, nodes, memdirs).wait()
