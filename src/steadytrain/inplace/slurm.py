"""The keeper under ``srun`` without torchrun: the rank's environment from Slurm's, and the
store that outlives every training process (rank 0's keeper hosts it).

    srun --ntasks-per-node 8 --kill-on-bad-exit=1 python -m steadytrain.inplace.keeper train.py

Under torchrun the agent gives each rank ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``... and
shares its TCPStore with the workers. ``srun`` starts one task per rank and gives only its
own variables; nothing hosts a store that outlives rank 0's training process, so before
this the keeper ran the script with in-place recovery off, and ``Run`` saw no ``RANK``
(rank 0 of 1 on every task). Here the keeper derives torch's variables from Slurm's
(``slurm_ranks``, pure) and rank 0's keeper hosts a ``torch.distributed.TCPStore`` at
``MASTER_ADDR:MASTER_PORT`` before it forks its training process (``host_store``). The
keeper outlives its training process, so the store does too; every keeper and training
process is a client. The child gets ``TORCHELASTIC_USE_AGENT_STORE=True``: torch's own
switch that makes ``init_process_group``'s ``env://`` rendezvous a client of a store hosted
by the launching process (torchrun's agent sets it for the same reason), so rank 0's
training process never tries to bind the keeper's port.

What it cannot survive: rank 0's keeper (the store's host) or a whole node dying. Then
every regroup fails to reach the store, each survivor exits with ``InPlaceFallback``, its
keeper passes the exit on, ``srun --kill-on-bad-exit=1`` ends the step and Slurm's requeue
is the whole restart, as without the keeper. A requeued job's keepers host a new store, so
the per-attempt prefixes (``TORCHELASTIC_RESTART_COUNT``, unset here: "0") never meet an
earlier attempt's keys. Rank 0's keeper leaves only once every rank's training process
ended well (``leave_together``, torchrun's exit barrier), so no rank loses the store while
it closes.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from collections.abc import Mapping

import torch.distributed as dist

__all__ = [
    "default_port",
    "first_host",
    "host_store",
    "leave_together",
    "slurm_ranks",
    "tasks_on_node",
]

_PORT_BASE, _PORT_SPAN = 15000, 10000  # a port from the job id: 15000-24999


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list (``node[07-09,12],gpu3`` -> ``node07``): each
    bracket's first number, its zero padding kept, as ``scontrol show hostnames`` lists it."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first entry ends at a comma outside brackets
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    host = re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", nodelist[:end].strip())
    if not host or any(c in host for c in "[],"):
        raise ValueError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    return host


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """The tasks on node ``node_id`` from Slurm's compact count (``2(x3),1``: 2 on each of
    the first three nodes, 1 on the fourth)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"cannot read Slurm's tasks per node {tasks_per_node!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"node {node_id} is not in Slurm's tasks per node {tasks_per_node!r}")
    return counts[node_id]


def default_port(job_id: str) -> int:
    """The store's port when ``MASTER_PORT`` is not given: from the job id, the same on
    every node (two steps of one job at once need their own ``MASTER_PORT``)."""
    return _PORT_BASE + int(job_id) % _PORT_SPAN


def slurm_ranks(env: Mapping[str, str]) -> dict[str, str] | None:
    """torch's variables for this task from ``srun``'s (None: not a task ``srun`` started,
    or one under torchrun, whose agent sets them). A batch script's own process has
    ``SLURM_PROCID=0`` and the allocation's ``SLURM_NTASKS`` but no step (``SLURM_STEP_ID``,
    seen on the harness's Slurm 22.05): it is one process, never a rank of N. The ranks are always Slurm's (an exported
    ``RANK`` is the same on every task); ``MASTER_ADDR``/``MASTER_PORT``, when set, win.
    ``ValueError`` names the variable that cannot be read."""
    if "TORCHELASTIC_RUN_ID" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    try:
        world = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
        nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"]
        derived = {
            "RANK": str(int(env["SLURM_PROCID"])),
            "WORLD_SIZE": str(int(world)),
            "LOCAL_RANK": str(int(env["SLURM_LOCALID"])),
            "LOCAL_WORLD_SIZE": str(tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0")))),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes),
            "MASTER_PORT": env.get("MASTER_PORT") or str(default_port(env["SLURM_JOB_ID"])),
        }
    except KeyError as e:
        raise ValueError(
            f"srun did not set {e.args[0]}: start the keeper with srun, one task per rank "
            "(srun ... python -m steadytrain.inplace.keeper SCRIPT)"
        ) from None
    return derived


def host_store(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's keeper: the store every rank's processes use, on ``port`` of every interface
    (``host``: the address its clients use, as torchrun's agent passes it). It does not
    wait for clients: they connect, retrying, as they start."""
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as e:  # noqa: BLE001 - said with the fix; the job cannot form a group
        raise SystemExit(
            f"steadytrain.inplace.keeper: rank 0 could not host the store on port {port} "
            f"({type(e).__name__}: {e}); set MASTER_PORT to a free port for this job"
        ) from e


_DONE_KEY = "steadytrain/inplace/keepers_done"


def leave_together(hosted: dist.TCPStore | None, world: int, timeout_s: float = 300.0) -> None:
    """Once this rank's training process ended well: rank 0's keeper (``hosted``: its store)
    must outlive every rank's use of the store, as torchrun's agents meet at an exit barrier.
    Each keeper counts itself; rank 0's waits until all ``world`` have, at most ``timeout_s``
    (then it warns and exits: a peer's failure is Slurm's to report, not a reason to hang)."""
    try:
        store = hosted or dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )
        done = store.add(_DONE_KEY, 1)
        deadline = time.monotonic() + timeout_s
        while hosted is not None and done < world and time.monotonic() < deadline:
            time.sleep(0.1)
            done = store.add(_DONE_KEY, 0)
    except Exception as e:  # noqa: BLE001 - the training is done; only the wait is lost
        done, why = -1, f"{type(e).__name__}: {e}"
    else:
        why = f"{done} of {world} ranks ended within {timeout_s:g} s"
    if hosted is not None and done < world or done < 0:
        print(
            f"steadytrain.inplace: leaving without every rank's end ({why}); the store it "
            "hosted goes with this keeper",
            file=sys.stderr,
            flush=True,
        )
