"""Launch N ranks of a script on one machine (no torchrun needed).

The rendezvous store is hosted here, on a port the kernel picks while the store binds it
(port 0), and every rank connects to it as a client -- what torchrun's agent does
(``TORCHELASTIC_USE_AGENT_STORE``). Choosing a "free" port and letting rank 0 bind it later
would race with any other process on the machine that binds in between. Each rank is
forked from a server that imported torch once (``steadytrain.testing.forkserver``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from steadytrain.testing import forkserver


def launch(script: str, args: list[str], world: int, timeout: float = 120) -> list[str]:
    """Run ``world`` ranks; raise with every rank's output if any rank fails."""
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of `store`
            OMP_NUM_THREADS="1",
        )
        procs.append(forkserver.popen([sys.executable, script, *args], env=env))
    outs, failed = [], False
    for p in procs:  # `store` serves until the last rank is done (it lives until return)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failed = True
        outs.append(out)
        failed |= p.returncode != 0
    if failed:
        raise AssertionError("\n".join(f"--- rank {i}\n{o[-3000:]}" for i, o in enumerate(outs)))
    return outs
