"""The save pipeline that runs after staging: DCP write, gather, upload, COMMIT, cleanup.

It runs inline (``sync``) or on a background thread (``thread``, ``process``); in ``process``
mode the DCP write itself happens in DCP's checkpoint daemon process, and this thread only
waits for it and then does the commit. Every collective here goes over the checkpointer's own
gloo group, never over the training group (a shared group deadlocks against DDP's gradient
all-reduce, see NOTES-environment.md). All ranks run the same sequence of collectives whether
their part succeeded or not, so a failure on one rank cannot leave another waiting.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint.remote import Root
from steadytrain.checkpoint.torch_private import identity_stager

__all__ = ["Group", "SaveRequest", "run_save", "rank_files", "FAILURES"]

# DCP's CheckpointException derives from BaseException; a failed save is still just a failure.
FAILURES: tuple[type[BaseException], ...] = (Exception,)
try:
    from torch.distributed.checkpoint.api import CheckpointException

    FAILURES = (Exception, CheckpointException)
except ImportError:  # pragma: no cover - older torch
    pass
_FAILURES = FAILURES

log = logging.getLogger("steadytrain.checkpoint")
# One rank without torch.distributed is a supported setup, not a mistake worth a warning.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


class Group:
    """Rank/world of the checkpoint group, with collectives that are no-ops for one rank."""

    def __init__(self, pg: Any = None) -> None:
        import torch.distributed as dist

        self.pg = pg
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(pg) if self.dist else 0
        self.world = dist.get_world_size(pg) if self.dist else 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]


@dataclass
class SaveRequest:
    step: int
    staged: dict[str, Any]  # DCP state dict, already snapshotted
    rank_json: dict[str, Any]  # this rank's RNG + JSON states
    tokens_seen: int
    async_mode: str
    block_s: float
    t_start: float  # perf_counter at the start of save()
    state_names: list[str]
    nbytes: int = 0  # staged tensor bytes (to diagnose a full disk)


def rank_files(directory: str, rank: int) -> list[str]:
    """Names of the files ``rank`` wrote into a checkpoint directory."""
    mine = []
    for name in os.listdir(directory):
        if name.startswith(f"__{rank}_") or name == f"state-rank{rank:05d}.json":
            mine.append(name)
        elif rank == 0 and name == ".metadata":
            mine.append(name)
    return sorted(mine)


def _choose_name(local: Root, remote: Root | None, step: int) -> str:
    taken = set(local.listdir()) | (set(remote.listdir()) if remote is not None else set())
    attempt = 0
    while C.step_dirname(step, attempt) in taken:
        attempt += 1  # a directory is never reused, not even a partial one
    return C.step_dirname(step, attempt)


def _dcp_write(req: SaveRequest, path: str, group: Group) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path)
    if req.async_mode == "process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        fut = dcp.async_save(
            req.staged,
            storage_writer=writer,
            process_group=group.pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=identity_stager(),  # staged already: DCP must not copy again
        )
        fut.result()
    else:
        dcp.save(req.staged, storage_writer=writer, process_group=group.pg, no_dist=not group.dist)


def run_save(
    req: SaveRequest, group: Group, local: Root, remote: Root | None, in_flight: list[str]
) -> dict[str, Any]:
    """Write, gather, upload, commit. Returns the ``checkpoint`` event (never raises)."""
    name, err, manifest = "", None, None
    try:
        name = group.broadcast(_choose_name(local, remote, req.step) if group.rank == 0 else None)
    except _FAILURES as exc:  # noqa: BLE001 - a broken group: report, training goes on
        err = f"choosing the directory failed: {exc}"
    in_flight[:] = [name]
    path = os.path.join(local.root, name) if name else ""
    entries: list[dict[str, Any]] = []
    if err is None:
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f"state-rank{group.rank:05d}.json"), "w") as f:
                json.dump(req.rank_json, f)
            _dcp_write(req, path, group)
            entries = [C.file_entry(path, n, group.rank) for n in rank_files(path, group.rank)]
        except _FAILURES as exc:  # noqa: BLE001
            err = f"rank {group.rank}: {_explain(exc, path, req.nbytes)}"
        err = _agree(group, err)
    if err is None and remote is not None:
        try:
            remote.upload(path, name, [e["path"] for e in entries])
        except _FAILURES as exc:  # noqa: BLE001
            err = f"rank {group.rank}: upload to {remote.url} failed: {type(exc).__name__}: {exc}"
        err = _agree(group, err)
    if err is None:
        all_entries = group.all_gather(entries)
        if group.rank == 0:
            try:
                files = [e for per_rank in all_entries for e in per_rank]
                manifest = C.make_manifest(
                    step=req.step,
                    files=files,
                    world_size=group.world,
                    tokens_seen=req.tokens_seen,
                    async_mode=req.async_mode,
                    states=req.state_names,
                    block_s=req.block_s,
                    extra={"remote": remote.url if remote is not None else None},
                )
                data = json.dumps(manifest, indent=1, sort_keys=True).encode()
                if remote is not None:
                    remote.put_commit(name, data)  # the remote COMMIT is the one that counts
                C.write_commit_local(path, manifest)
            except _FAILURES as exc:  # noqa: BLE001
                err = f"commit failed: {type(exc).__name__}: {exc}"
        err, manifest = group.broadcast((err, manifest)) if group.world > 1 else (err, manifest)
    if err is not None and name:
        _discard(path, remote, name, group)
    durable_s = time.perf_counter() - req.t_start
    if err is not None:
        log.warning("checkpoint of step %d failed (training goes on): %s", req.step, err)
    return {
        "type": "checkpoint",
        "step": req.step,
        "block_s": req.block_s,
        "durable_s": durable_s,
        "ok": err is None,
        "path": (remote.path(name) if remote is not None else path) if name else "",
        "error": err,
        "bytes": manifest["total_bytes"] if manifest else 0,
    }


def _explain(exc: BaseException, path: str, nbytes: int) -> str:
    """A short, actionable message (DCP reports a full disk as 'unexpected pos 704 vs 598')."""
    import shutil

    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    said = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
    try:
        free = shutil.disk_usage(os.path.dirname(path) or ".").free
    except OSError:
        return said
    if isinstance(exc, OSError) and exc.errno == 28 or free < max(nbytes, 1) + (1 << 20):
        return (
            f"No space left on device: {os.path.dirname(path)} has {free} bytes free and this "
            f"checkpoint needs about {nbytes}; free space, lower keep_last, or point the "
            f"checkpoint directory at a larger disk ({said})"
        )
    return said


def _agree(group: Group, err: str | None) -> str | None:
    """Every rank learns whether any rank failed (the same collective on success and failure)."""
    try:
        errs = [e for e in group.all_gather(err) if e]
    except _FAILURES as exc:  # noqa: BLE001
        return err or f"rank {group.rank}: checkpoint group failed: {exc}"
    return "; ".join(errs) if errs else None


def _discard(path: str, remote: Root | None, name: str, group: Group) -> None:
    """A failed save leaves nothing behind (a full disk must not stay full)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    if remote is not None and group.rank == 0:
        try:
            remote.remove(name)
        except _FAILURES as exc:  # noqa: BLE001 - the store may be down; retention retries
            log.warning("could not remove failed checkpoint %s on %s: %s", name, remote.url, exc)
