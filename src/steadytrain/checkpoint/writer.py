"""The save pipeline that runs after staging: DCP write, gather, upload, COMMIT, cleanup.

It runs inline (``sync``) or on a background thread (``thread``, ``process``); in ``process``
mode the DCP write itself happens in DCP's checkpoint daemon process, and this thread only
waits for it and then does the commit. Every collective here goes over the checkpointer's own
gloo group, never over the training group (a shared group deadlocks against DDP's gradient
all-reduce, see NOTES-environment.md). All ranks run the same sequence of collectives whether
their part succeeded or not, so a failure on one rank cannot leave another waiting.

Two guards keep one job's checkpoints apart from another's: rank 0 first runs the caller's
``fence`` (the writer lease must still be this job's, ``lease.py``), then claims a directory
name no one has used (``claim.py``), so two writers never put files into one directory.

In ``process`` mode DCP keeps one checkpoint daemon per process and never notices its death
(every later save then fails with ``BrokenPipeError``). Each save therefore starts with one
all-gather of "is my daemon alive"; if any rank's daemon died, every rank forgets its daemon
together and the save starts new ones, or, once the restart budget is spent, writes from
this thread instead (``thread`` mode). The returned event says which (``daemon``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint.claim import claim_name
from steadytrain.checkpoint.hashing_writer import (
    CheckpointWriter,
    fsync_files,
    hashing_writer,
    rank_entries,
    rank_files,
    write_rank_json,
)
from steadytrain.checkpoint.lease import LeaseLostError
from steadytrain.checkpoint.remote import Root
from steadytrain.checkpoint.repeat_save import PlanCache
from steadytrain.checkpoint.torch_private import (
    checkpoint_daemon,
    forget_checkpoint_daemon,
    identity_stager,
)

__all__ = ["Group", "SaveRequest", "run_save", "rank_files", "FAILURES"]

_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", 122)}

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
    daemon_restarts_left: int = 0  # process mode: new daemons allowed before thread mode
    job: str = ""  # the job identity, written into remote CLAIMs for whoever reads them
    run_nonce: str | None = None  # the run's identity (run_identity.py), into COMMIT
    tensor_format: str = "raw"  # CheckpointWriter's: raw records or torch.save archives
    plans: PlanCache | None = None  # the checkpointer's last planned layout (repeat_save.py)
    layout_version: int = 0  # the Stager's, of ``staged``


def _recover_daemon(group: Group, req: SaveRequest) -> dict[str, Any] | None:
    """Collective (process mode): if DCP's checkpoint daemon died on any rank, every rank
    forgets (and kills) its daemon, so this save starts new ones together -- or writes from
    this thread when ``req.daemon_restarts_left`` is 0. None when every daemon is alive."""
    try:
        state = checkpoint_daemon()
        mine = None
        if state is not None and state[1] is not None:
            pid, code = state
            mine = f"rank {group.rank}: DCP's checkpoint daemon (pid {pid}) exited with code {code}"
        dead = [d for d in group.all_gather(mine) if d]
        if not dead:
            return None
        forget_checkpoint_daemon()
    except _FAILURES as exc:  # noqa: BLE001 - the save itself will report the broken group
        log.warning("could not check DCP's checkpoint daemon: %s", exc)
        return None
    action = "restart" if req.daemon_restarts_left > 0 else "fallback_thread"
    reason = "; ".join(dead)
    then = "starting new daemons" if action == "restart" else "saving from a thread from now on"
    log.warning("%s; %s (async_mode='process' recovery)", reason, then)
    return {"action": action, "reason": reason}


def _reusable(req: SaveRequest, group: Group, mode: str) -> list[Any] | None:
    """Collective (when the checkpointer keeps plans): the bytes of this rank's records when
    every rank can write the layout DCP planned for an earlier save (``repeat_save.py``),
    else None on every rank, and DCP plans this save."""
    if req.plans is None or mode == "process":
        return None
    chunks = req.plans.bind(req.staged, req.layout_version)
    # the same collective on every rank, bound or not: all reuse, or DCP plans for all
    return chunks if all(group.all_gather(chunks is not None)) else None


def _dcp_write(
    req: SaveRequest, path: str, group: Group, mode: str, chunks: list[Any] | None
) -> dict[str, tuple[int, str]]:
    """DCP writes (and fsyncs) this rank's shards, or, given ``chunks`` (``_reusable``),
    the records of the layout it planned before; returns the (size, xxh3-64) of each file
    hashed on the way (``hashing_writer.py``; none in ``process`` mode, where DCP writes in
    its daemon process)."""
    import torch.distributed.checkpoint as dcp

    if mode == "process":
        # pickled to the daemon: no digests come back
        writer = CheckpointWriter(path, tensor_format=req.tensor_format)
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        fut = dcp.async_save(
            req.staged,
            storage_writer=writer,
            process_group=group.pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=identity_stager(),  # staged already: DCP must not copy again
        )
        fut.result()
        return {}
    plans = req.plans
    if plans is not None and chunks is not None:
        return plans.write(path, chunks, group.rank)
    writer, fs = hashing_writer(path, tensor_format=req.tensor_format)
    dcp.save(req.staged, storage_writer=writer, process_group=group.pg, no_dist=not group.dist)
    if plans is not None:
        try:
            plans.learn(writer, req.staged, path, req.layout_version, group.rank)
        except Exception:  # noqa: BLE001 - the save succeeded; the next one is planned again
            plans.forget()
            log.exception("could not keep the plan of the checkpoint in %s", path)
    return fs.digests


def run_save(
    req: SaveRequest,
    group: Group,
    local: Root,
    remote: Root | None,
    in_flight: list[str],
    *,
    fence: Callable[[], None] | None = None,
    before_commit: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Write, gather, upload, commit. Returns the ``checkpoint`` event (never raises), with
    ``lease_lost`` when ``fence`` (run on rank 0 before the claim and before COMMIT) said
    another job took the root, and ``daemon`` when process mode replaced DCP's daemon.
    ``before_commit`` runs on rank 0 just before COMMIT (the ledger catches up to the step:
    ``Checkpointer``); if it fails, the checkpoint still commits."""
    manifest, mode, daemon, planned = None, req.async_mode, None, ""
    if mode == "process":
        daemon = _recover_daemon(group, req)
        if daemon is not None and daemon["action"] == "fallback_thread":
            mode = "thread"
    picked: tuple[str, str | None, bool] = ("", None, False)
    if group.rank == 0:
        try:
            if fence is not None:
                fence()
            picked = (claim_name(local, remote, req.step, req.job), None, False)
        except LeaseLostError as exc:
            picked = ("", str(exc), True)
        except _FAILURES as exc:  # noqa: BLE001 - reported; training goes on
            picked = ("", f"choosing the directory failed: {type(exc).__name__}: {exc}", False)
    try:  # rank 0's outcome, failure included: no rank may wait for a name that never comes
        name, err, lease_lost = group.broadcast(picked)
    except _FAILURES as exc:  # noqa: BLE001 - a broken group: report, training goes on
        name, err, lease_lost = "", f"choosing the directory failed: {exc}", False
    in_flight[:] = [name]
    path = os.path.join(local.root, name) if name else ""
    entries: list[dict[str, Any]] = []
    if err is None:
        try:
            os.makedirs(path, exist_ok=True)  # rank 0 created (claimed) it; other nodes make theirs
            json_name, json_digest = write_rank_json(path, group.rank, req.rank_json)
            chunks = _reusable(req, group, mode)
            planned = "dcp" if chunks is None else "reused"
            known = _dcp_write(req, path, group, mode, chunks)
            known[json_name] = json_digest
            fsync_files(path, [json_name])
            entries = rank_entries(path, group.rank, known)
        except _FAILURES as exc:  # noqa: BLE001
            err = f"rank {group.rank}: {_explain(exc, path, req.nbytes)}"
        if remote is not None:
            err = _agree(group, err)
            if err is None:
                try:
                    remote.upload(path, name, [e["path"] for e in entries])
                except _FAILURES as exc:  # noqa: BLE001
                    err = (
                        f"rank {group.rank}: upload to {remote.url} failed: "
                        f"{type(exc).__name__}: {exc}"
                    )
        # One collective: every rank learns whether any rank failed, rank 0 gets the files.
        err, all_entries = _agree_entries(group, err, entries)
    if err is None:
        if group.rank == 0:
            try:
                if fence is not None:
                    fence()  # a job that lost the root since its claim commits nothing
                _before_commit(before_commit, req.step)
                files = [e for per_rank in all_entries for e in per_rank]
                manifest = C.make_manifest(
                    step=req.step,
                    files=files,
                    world_size=group.world,
                    tokens_seen=req.tokens_seen,
                    async_mode=req.async_mode,
                    tensor_format=req.tensor_format,
                    states=req.state_names,
                    block_s=req.block_s,
                    extra={
                        "remote": remote.url if remote is not None else None,
                        **({"run_nonce": req.run_nonce} if req.run_nonce else {}),
                    },
                )
                data = json.dumps(manifest, indent=1, sort_keys=True).encode()
                if remote is not None:
                    remote.put_commit(name, data)  # the remote COMMIT is the one that counts
                C.write_commit_local(path, manifest)
            except LeaseLostError as exc:
                err, lease_lost = str(exc), True
            except _FAILURES as exc:  # noqa: BLE001
                err = f"commit failed: {type(exc).__name__}: {exc}"
        if group.world > 1:
            err, manifest, lease_lost = group.broadcast((err, manifest, lease_lost))
    if err is not None and name:
        _discard(path, remote, name, group)
    durable_s = time.perf_counter() - req.t_start
    if err is not None:
        log.warning("checkpoint of step %d failed (training goes on): %s", req.step, err)
    extra: dict[str, Any] = {"daemon": daemon} if daemon is not None else {}
    if lease_lost:
        extra["lease_lost"] = True
    return extra | {
        "type": "checkpoint",
        "step": req.step,
        "block_s": req.block_s,
        "durable_s": durable_s,
        "ok": err is None,
        "path": (remote.path(name) if remote is not None else path) if name else "",
        "error": err,
        "bytes": manifest["total_bytes"] if manifest else 0,
        "plan": planned,  # "dcp", "reused" (repeat_save.py), "" when nothing was written
    }


def _before_commit(hook: Callable[[], Any] | None, step: int) -> None:
    """Run the pre-COMMIT hook; a failing one is logged, never a lost checkpoint (the ledger
    then recovers the steps at the next start-up: ``monitor.recovered``)."""
    if hook is None:
        return
    try:
        if hook() is False:
            log.warning("checkpoint of step %d: the ledger did not catch up before COMMIT", step)
    except Exception:  # noqa: BLE001 - a recovery point outweighs a ledger line
        log.exception("checkpoint of step %d: the pre-COMMIT hook failed", step)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures that DCP's
    ``CheckpointException.failures`` wraps (``{rank: (exception, traceback)}``)."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple) and e:
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())


def _probe_space(directory: str, nbytes: int) -> int | None:
    """Write and fsync up to 1 MiB where the checkpoint was going: None when the file system
    takes it, else the errno it refused with."""
    probe = os.path.join(directory, f".space-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    left = min(max(nbytes, 1), 1 << 20)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            while left > 0:  # a short write is followed by the write that raises
                left -= os.write(fd, bytes(min(left, 1 << 16)))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.errno or errno.EIO
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def _explain(exc: BaseException, path: str, nbytes: int) -> str:
    """A short, actionable message. "No space left on device" (or "Disk quota exceeded") only
    when the OS said ENOSPC (EDQUOT): found in the exception chain, or -- torch's zip writer
    reports a short write as 'unexpected pos 704 vs 598' and drops the OS error -- reproduced
    by a small probe write where the checkpoint was going. Low free space alone proves
    nothing: an unrelated error keeps its own message."""
    import shutil

    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    said = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
    directory = os.path.dirname(path) or "."
    code = next(
        (e.errno for e in _chain(exc) if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS),
        None,
    )
    if code is None and any("unexpected pos" in str(e) for e in _chain(exc)):
        probe = _probe_space(path if os.path.isdir(path) else directory, nbytes)
        if probe is None:
            return (
                f"{said} (a short write; {directory} still accepts writes, so not a full "
                "disk: check the device and the kernel log)"
            )
        if probe not in _SPACE_ERRNOS:
            return (
                f"{said} (a short write; a test write in {directory} failed too with "
                f"{errno.errorcode.get(probe, probe)}: check the device and the kernel log)"
            )
        code = probe
    if code is None:
        return said
    try:
        free = f"{shutil.disk_usage(directory).free} bytes free"
    except OSError:
        free = "unknown free space"
    quota = code != errno.ENOSPC
    return (
        f"{'Disk quota exceeded' if quota else 'No space left on device'}: {directory} has "
        f"{free} and this checkpoint needs about {nbytes}; free space, lower keep_last, "
        f"{'raise the quota, ' if quota else ''}or point the checkpoint directory at a larger "
        f"disk ({said})"
    )


def _agree(group: Group, err: str | None) -> str | None:
    """Every rank learns whether any rank failed (the same collective on success and failure)."""
    try:
        errs = [e for e in group.all_gather(err) if e]
    except _FAILURES as exc:  # noqa: BLE001
        return err or f"rank {group.rank}: checkpoint group failed: {exc}"
    return "; ".join(errs) if errs else None


def _agree_entries(
    group: Group, err: str | None, entries: list[dict[str, Any]]
) -> tuple[str | None, list[list[dict[str, Any]]]]:
    """``_agree`` and the gather of every rank's COMMIT entries in one collective."""
    try:
        gathered = group.all_gather((err, entries))
    except _FAILURES as exc:  # noqa: BLE001
        return err or f"rank {group.rank}: checkpoint group failed: {exc}", []
    errs = [e for e, _ in gathered if e]
    return ("; ".join(errs) if errs else None), [per_rank for _, per_rank in gathered]


def _discard(path: str, remote: Root | None, name: str, group: Group) -> None:
    """A failed save leaves nothing behind (a full disk must not stay full)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    if remote is not None and group.rank == 0:
        try:
            remote.remove(name)
        except _FAILURES as exc:  # noqa: BLE001 - the store may be down; retention retries
            log.warning("could not remove failed checkpoint %s on %s: %s", name, remote.url, exc)
