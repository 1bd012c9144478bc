"""One live job per run directory: ``steadytrain.Run`` takes ``RUN_DIR/.run-lease/`` at entry.

A second job started on a live job's run directory restored the same checkpoint, trained,
and wrote into the same ledger and rank files before anything stopped it (issue 40, 3): its
first save met the checkpoint writer lease, and with ``checkpoint=False`` (both trainer
callbacks' path) nothing ever did; the first job's report then showed an invented crash and
more recorded time than wall time. ``Run`` now refuses it at entry, before any restore and
before any record.

The mechanism is the checkpoint writer lease's (``checkpoint/lease.py``, kind ``RUN_LEASE``):
it already has every rule a run directory needs -- a restart of the same job takes over at
once (its job identity: ``torchrun --rdzv-id``, ``SLURM_JOB_ID`` across a requeue,
``checkpoint.job_id``), a holder whose pid is gone from this host (SIGKILL, a crashed
node's process) is free at once, a holder on another host (whose pid cannot be checked) is
free once its heartbeat is older than ``lease_timeout_s``, a clean close releases it, and
hostile lease files are read as untrusted input. It reaches the disk through
``storage.Store`` (a hard link creates a generation only if absent), so two starts racing
cannot both win. A second lease module would have copied all of that.

Rank 0 decides and broadcasts the verdict before any rank builds its meter, so a refused
start raises ``RunDirInUseError`` on every rank and no rank wrote anything. When rank 0 is
unsure -- the run directory's disk refuses the lease file -- it warns and the job runs
without the lease ("a harm the product causes is worse than a fault it misses").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from steadytrain.checkpoint.identity import job_identity
from steadytrain.checkpoint.lease import DEFAULT_TIMEOUT_S, Lease, acquire
from steadytrain.checkpoint.lease_kinds import RUN_LEASE
from steadytrain.errors import RunDirInUseError, SteadyError
from steadytrain.storage.store import Store

__all__ = ["take_run_lease", "lease_settings"]


def lease_settings(checkpoint: Any) -> tuple[str, float]:
    """(job identity, lease timeout) for a Run given ``checkpoint=``: the checkpointer
    config's ``job_id`` and ``lease_timeout_s`` when it has them (one notion of "this job"
    and of how long a dead holder on another host blocks), else the job identity from the
    environment and the writer lease's default timeout."""
    explicit = getattr(checkpoint, "job_id", None)
    timeout = getattr(checkpoint, "lease_timeout_s", None)
    if isinstance(checkpoint, dict):
        explicit, timeout = checkpoint.get("job_id"), checkpoint.get("lease_timeout_s")
    if getattr(checkpoint, "config", None) is not None:  # a ready Checkpointer
        explicit = getattr(checkpoint.config, "job_id", explicit)
        timeout = getattr(checkpoint.config, "lease_timeout_s", timeout)
    explicit = explicit if isinstance(explicit, str) else ""
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    return job_identity(explicit), float(timeout) if ok else DEFAULT_TIMEOUT_S


def take_run_lease(
    run_dir: str,
    rank: int,
    *,
    job: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    say: Callable[[str], None],
    share: bool = True,
) -> Lease | None:
    """Rank 0 takes ``run_dir``'s run lease; every rank of the process group learns the
    verdict. Returns rank 0's lease (None on the other ranks, or when rank 0 could not
    write one). Raises ``RunDirInUseError`` on every rank when another live job holds it.
    ``share=False``: no collective (rank 0's verdict stays its own): for a failure path on
    which the other ranks may be anywhere."""
    verdict: tuple[str, str] = ("ok", "")
    lease: Lease | None = None
    if rank == 0:
        try:
            store = Store(os.path.abspath(run_dir))
            lease = acquire(store, job=job, timeout_s=timeout_s, kind=RUN_LEASE)
        except RunDirInUseError as exc:
            verdict = ("refused", str(exc))
        except (SteadyError, OSError) as exc:  # unsure: warn, and let the job run
            say(
                f"warning: could not take the run directory lease of {run_dir} "
                f"({type(exc).__name__}: {exc}); training goes on without it, so a second job "
                "started on this run directory would not be refused"
            )
    try:
        if share and dist.is_initialized() and dist.get_world_size() > 1:
            box = [verdict]
            dist.broadcast_object_list(box, src=0)
            verdict = box[0]
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    if verdict[0] == "refused":
        raise RunDirInUseError(verdict[1])
    return lease
