"""Leave a broken process group and form a new one with the same ranks (mechanism), and the
choice of the step every rank resumes from (``agree``, pure).

A survivor's collective raises once its peer died: gloo closes the pair's socket and the
blocked call raises within tens of milliseconds of a SIGKILL (``bench/inplace_detect.py``);
a stopped peer is only seen at the group's timeout, so a stopped rank is for the hang
watchdog to reap, which makes it a killed one. The survivor then destroys every process
group it holds (NCCL: aborts its communicators first, since a destroy would wait on the
dead peer), and every member (the survivors and the replaced rank) joins a new default
group on a fresh prefix of torchrun's TCPStore (which outlives any training process), with
the same rank and world size. The generation is agreed through that store: every member
adds 1 to one counter as it arrives, so arrival n belongs to generation ceil(n / world).
A member counted into the wrong generation waits for peers that never come and times out:
doubt ends in ``InPlaceFallback``, never in a group of the wrong members.

The members then agree on the point to resume from (``agree``, pure): the survivors' live
states at the start of the failed step when every survivor holds the same one (live.py),
else the newest in-memory snapshot every member holds, else the whole restart.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch.distributed as dist

from steadytrain.checkpoint import torch_private as tp

__all__ = [
    "InPlaceFallback",
    "Report",
    "agree",
    "formed",
    "is_peer_loss",
    "join",
    "leave",
    "not_live",
    "restore_failed",
    "store",
]

# Messages of a collective whose peer is gone (gloo raises a plain RuntimeError; torch's own
# DistError subclasses are recognised by type). Anything else is the script's own error.
_PEER_LOSS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "NCCL communicator was aborted",
    "NCCL error",
)


class InPlaceFallback(RuntimeError):
    """In-place recovery cannot go on with certainty: the process exits with this error, its
    keeper passes the exit on, and torchrun's whole restart takes over."""


def restore_failed(rank: int, exc: BaseException) -> InPlaceFallback:
    """The fallback for a restore that raised: a half-restored state must never train."""
    return InPlaceFallback(
        f"rank {rank}: in-place restore failed ({type(exc).__name__}: {exc}); torchrun's "
        "whole restart takes over"
    )


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone (not a bug of ours)."""
    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_LOSS)


def store(timeout_s: float) -> dist.Store:
    """A client of the store that outlives the training processes: torchrun's shared
    TCPStore, or under srun the one rank 0's keeper hosts (the keeper checked for either)."""
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as e:
        raise InPlaceFallback(
            f"in-place regroup needs MASTER_ADDR and MASTER_PORT (torchrun's, or the keeper's "
            f"under srun) ({e})"
        ) from e
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def leave(backend: str) -> None:
    """Drop every process group this process holds. NCCL communicators are aborted first: a
    plain destroy would wait for kernels that wait on the dead peer. (Written from torch's
    API, not run here: this machine has no GPU.)"""
    if not dist.is_initialized():
        return
    if backend == "nccl":
        abort = tp.abort_process_groups()
        if abort is None:
            raise InPlaceFallback(
                "this torch has no distributed_c10d._abort_process_group: an NCCL group "
                "blocked on a dead peer cannot be left in place"
            )
        abort()
        return
    dist.destroy_process_group()


# The default group this process's last ``join`` formed: (attempt, generation, group).
_FORMED: tuple[str, int, Any] | None = None


def formed(attempt: str) -> int | None:
    """The generation of the default group if ``join`` formed it in this attempt (a loop
    that shards its model before ``Run`` forms it early: ``run_inplace.form_group``)."""
    if _FORMED is None or not dist.is_initialized():
        return None
    at, generation, group = _FORMED
    return generation if at == attempt and group is dist.group.WORLD else None


def join(
    backend: str, rank: int, world: int, timeout_s: float, attempt: str, first: bool = False
) -> tuple[int, dist.Store]:
    """Join the next generation's group (the default group); its generation number.

    ``first``: the attempt's first group (generation 0), which every process of a torchrun
    attempt forms at start. It too lives under the attempt's own prefix: torchrun's shared
    store keeps the previous attempt's gloo addresses under the default one, and a whole
    restart's processes that read them fail to connect (pytorch/pytorch#135712, seen here)."""
    try:
        base = store(timeout_s)
        prefix = f"steadytrain/inplace/{attempt}"
        generation = 0
        if not first:
            generation = (base.add(f"{prefix}/arrivals", 1) - 1) // world + 1
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"{prefix}/g{generation}/", base),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except InPlaceFallback:
        raise
    except Exception as e:  # noqa: BLE001 - any doubt: the whole restart
        raise InPlaceFallback(
            f"rank {rank}: could not form a new process group in place within {timeout_s:g} s "
            f"({type(e).__name__}: {e}); torchrun's whole restart takes over"
        ) from e
    global _FORMED
    _FORMED = (attempt, generation, dist.group.WORLD)
    return generation, base


@dataclasses.dataclass(frozen=True)
class Report:
    """What one member brings to a regroup. ``steps``: the snapshot steps it can restore
    (survivors: the process's own memory; the replaced rank: the steps whose per-rank state
    it can read back). ``live``: a survivor's step whose start it still holds live (its
    optimizers did not step in the failed step; None otherwise, and for a replaced rank).
    ``own_live``: the replaced rank's steps whose per-rank state (live slots) is in the
    store; ``ahead``: those of them its optimizer's step pre-hook published before it reached
    the step (live.py's ``Ahead``). ``proven``: a survivor proved at the start of its live
    step that the pre-hook publication was its true state, and never saw it differ.
    ``replaced``: whether it is the replaced process."""

    rank: int
    steps: tuple[int, ...]
    replaced: bool
    live: int | None = None
    own_live: tuple[int, ...] = ()
    ahead: tuple[int, ...] = ()
    proven: bool = False


def not_live(reports: list[Report]) -> str | None:
    """Why the live states cannot be the agreed point (None: they can): every survivor must
    hold the start of the same step live, and every replaced rank its per-rank state of it;
    a state its optimizer's pre-hook published ahead counts only if every survivor proved
    that publication right at that step (the ranks run the same loop)."""
    lives = {r.rank: r.live for r in reports if not r.replaced}
    stepped = [rank for rank, s in lives.items() if s is None]
    if stepped:
        return f"rank(s) {stepped} stepped their optimizer in the failed step or hold no live state"
    if len(set(lives.values())) > 1:
        at = ", ".join(f"rank {rank} at {s}" for rank, s in lives.items())
        return f"the survivors are at different steps ({at})"
    step = next(iter(lives.values()))
    missing = [r.rank for r in reports if r.replaced and step not in r.own_live]
    if missing:
        return f"no per-rank state of step {step} in the store for replaced rank(s) {missing}"
    ahead = [r.rank for r in reports if r.replaced and step in r.ahead]
    unproven = [r.rank for r in reports if not r.replaced and not r.proven]
    if ahead and unproven:
        return (
            f"the per-rank state of step {step} of replaced rank(s) {ahead} was published at "
            f"its optimizer step, and survivor(s) {unproven} did not prove that right (the "
            "loop changes a per-rank state after optimizer.step(), or the step was not checked)"
        )
    return None


def agree(reports: list[Report]) -> tuple[int, int, bool]:
    """(step, source, live): the step every rank resumes from, the survivor that sends the
    replicated states (the lowest rank that lived through it), and whether they are the
    survivors' live states (at the start of the failed step: nothing is redone) or
    snapshots (the newest step every member holds). ``InPlaceFallback`` when no survivor is
    left or neither applies: never a state that is not provably the agreed one."""
    survivors = [r for r in reports if not r.replaced]
    if not survivors:
        raise InPlaceFallback(
            "every rank is a replacement: no process kept its state; torchrun's whole "
            "restart takes over"
        )
    source = min(r.rank for r in survivors)
    why = not_live(reports)
    if why is None:
        return int(survivors[0].live), source, True  # type: ignore[arg-type]
    common = set(reports[0].steps).intersection(*(r.steps for r in reports[1:]))
    if not common:
        held = "; ".join(f"rank {r.rank}: {list(r.steps)}" for r in reports)
        raise InPlaceFallback(
            f"not live ({why}), and no snapshot step is held by every rank ({held}); "
            "torchrun's whole restart takes over"
        )
    return max(common), source, False


def exchange(report: Report) -> list[Report]:
    """Every member's ``Report``, on the new default group."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dataclasses.astuple(report))
    return [
        Report(
            int(g[0]),
            tuple(int(s) for s in g[1]),
            bool(g[2]),
            None if g[3] is None else int(g[3]),
            tuple(int(s) for s in g[4]),
            tuple(int(s) for s in g[5]),
            bool(g[6]),
        )
        for g in gathered
    ]
