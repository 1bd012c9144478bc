"""Start a bench script's ranks on this machine (gloo, no torchrun): one process per rank,
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and a rendezvous port on 127.0.0.1, one thread each."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable


def spawn_ranks(
    script: str,
    world: int,
    args: list[str],
    env_of: Callable[[int], dict[str, str]] = lambda r: {},
) -> list[subprocess.Popen]:
    """``script args`` as ``world`` ranks; ``env_of(rank)``: that rank's extra variables."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **env_of(r),
        )
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env))
    return procs
