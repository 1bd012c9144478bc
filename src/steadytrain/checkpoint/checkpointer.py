"""Checkpointer: when to save, at most one save in flight, retention, automatic resume.

Usage (every rank constructs it, after ``init_process_group``)::

    ckpt = Checkpointer("ckpts/", every_steps=100, keep_last=3, async_mode="thread")
    step = ckpt.restore_latest({"model": model, "optim": optim, "loader": loader})
    for step in range(step + 1, total + 1):
        ...  # forward, backward, optimizer.step()
        block_s = ckpt.maybe_save(step, {"model": model, "optim": optim, "loader": loader},
                                  tokens_seen=tokens)
    ckpt.close()

In-flight policy: at most one save is in flight. When the next save is due before the previous
one is durable, the caller waits for the previous one to finish, and that wait is counted in
the returned blocked seconds (``block_s``). Skipping instead would need every rank to agree on
"still busy", one more collective per step; waiting keeps all ranks in lockstep for free and
makes a too-short interval visible as checkpoint stall in the goodput ledger.

One writer per root: the first save takes the writer lease (``lease.py``) on the directory
and on ``remote=``; a second live job is refused there with a ``CheckpointError`` that names
the job holding it. A job that finds its lease taken by another stops saving the same way.
A restore takes no lease: reading a root another job writes is fine.

Process mode survives the death of DCP's checkpoint daemon: the next save starts a new one
(``DAEMON_RESTARTS`` times), then falls back to thread mode; each is a ``checkpoint_daemon``
event. Checkpoint events carry ``every_steps`` and ``interval_s`` so the alert engine can
say when the recovery point is older than two intervals.

A committed step is a recorded step: ``before_commit(step)`` (the meter's
``record_through``) runs on rank 0 just before COMMIT and returns once the ledger holds the
step records up to ``step`` (``step - 1`` for a sync save: docs/monitoring.md).

The memory tier (``config.memory.every_steps`` = K > 0, ``memory/``): every K steps
``maybe_save`` also snapshots the states into node-local memory and a peer's, in the
background on a gloo group of its own (made here, on every rank), and ``restore_latest``
restores the newest good point of either tier (memory wins a tie). ``close()`` removes this
node's snapshots when nothing in them is newer than the last committed durable save.

The run's identity (``run_nonce``, run_identity.py) goes into every COMMIT and every memory
snapshot, and nothing of another run is restored. ``Run`` sets it before ``restore_latest``
(adopting ``newest_run_nonce()`` when its run directory has none). A checkpointer used
without ``Run`` with the memory tier on establishes one itself, in its checkpoint directory,
before its first snapshot, save or restore (``_ensure_nonce``): rank 0 reads or makes it and
broadcasts it. Without either, COMMITs carry none and the durable restore compares nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.config import CheckpointerConfig
from steadytrain.checkpoint.identity import job_identity
from steadytrain.checkpoint.lease import Lease, acquire
from steadytrain.checkpoint.memory.config import MemoryConfig
from steadytrain.checkpoint.memory.plan import newest_durable_step
from steadytrain.checkpoint.memory.tier import MemoryTier
from steadytrain.checkpoint.remote import Root, discover, newest_manifest
from steadytrain.checkpoint.repeat_save import PlanCache
from steadytrain.checkpoint.restore import restore_latest as _restore
from steadytrain.checkpoint.staging import Stager
from steadytrain.checkpoint.writer import FAILURES, Group, SaveRequest, run_save
from steadytrain.errors import CheckpointError, ConfigError, SteadyError
from steadytrain.run_identity import establish, is_nonce, new_nonce
from steadytrain.settings import merge

__all__ = ["Checkpointer", "CheckpointerConfig", "DAEMON_RESTARTS"]

log = logging.getLogger("steadytrain.checkpoint")

# New DCP checkpoint daemons a process-mode job starts after one died; when the replacement
# dies too, something kills it (the OOM killer, a memory limit): thread mode needs no
# second process, so the job keeps its checkpoints.
DAEMON_RESTARTS = 1


class Checkpointer:
    """Sharded, asynchronous DCP checkpoints with a COMMIT written last."""

    def __init__(
        self,
        directory: str,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        interval: str | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_mode: str | None = None,
        remote: str | None = None,
        process_group: Any = None,
        on_event: Callable[[dict], None] | None = None,
        before_commit: Callable[[int], Any] | None = None,
        *,
        mtbf_s: float | None = None,
        restart_s: float | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: str | None = None,
        job_id: str | None = None,
        lease_timeout_s: float | None = None,
        tensor_format: str | None = None,
        reuse_plans: bool | None = None,
        memory: MemoryConfig | dict[str, Any] | None = None,
        config: CheckpointerConfig | None = None,
    ) -> None:
        """``config=`` or keywords (a keyword given wins over ``config``); every default
        lives in ``CheckpointerConfig``. ``process_group``, ``on_event`` and
        ``before_commit`` are runtime objects, not settings."""
        cfg = merge(CheckpointerConfig, config, locals())
        self.config = cfg
        async_mode, interval = cfg.async_mode, cfg.interval
        remote, storage_options = cfg.remote or None, cfg.storage_options or None
        if interval == "auto":
            self._optimal = _planner()
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        if async_mode == "process" and not initialised:
            raise ConfigError(
                "async_mode='process' needs torch.distributed initialised (a 1-rank gloo "
                "group is enough); or use async_mode='thread'"
            )
        if initialised and process_group is None:
            # Its own gloo group: async writes on the training group deadlock against DDP.
            process_group = dist.new_group(backend="gloo")
        self.group = Group(process_group)
        self._decide = None
        if initialised and self.group.world > 1 and interval != "steps":
            self._decide = dist.new_group(backend="gloo")  # time-based decisions, loop thread
        self.local = Root(directory)
        if not self.local.is_local:
            raise ConfigError(
                f"directory={directory!r} must be a local path; pass the URL as remote= and "
                "checkpoints are staged locally, then uploaded"
            )
        self.remote = Root(remote, storage_options) if remote else None
        # Read on every step and save: plain attributes, copied from the config.
        self.every_steps, self.every_seconds, self.interval = (
            cfg.every_steps,
            cfg.every_seconds,
            interval,
        )
        self.keep_last, self.keep_every, self.async_mode = cfg.keep_last, cfg.keep_every, async_mode
        self.mtbf_s, self.restart_s = cfg.mtbf_s, cfg.restart_s
        self.on_event = on_event
        self.before_commit = before_commit
        self.verify = cfg.verify
        self._stager = Stager(shared_memory=async_mode == "process")
        # the last planned save's layout, reused while it holds (raw records only)
        self._plans = PlanCache() if cfg.tensor_format == "raw" and cfg.reuse_plans else None
        self._thread: threading.Thread | None = None
        self._results: list[dict[str, Any]] = []  # events of the finished save, in order
        self._leases: list[Lease] | None = None  # None: not taken yet (rank 0 holds them)
        self._job = job_identity(cfg.job_id)
        self._fatal: str | None = None  # this job lost its lease: saving stops, loudly
        self._daemon_restarts_left = DAEMON_RESTARTS
        self._in_flight: list[str] = []
        # Directories whose save this process saw commit. On nodes other than rank 0's, the
        # node-local staging copy has no COMMIT (rank 0 writes it), so retention there needs
        # this list to tell committed copies from torn ones.
        self._committed_here: list[str] = []
        self._last_save_t = time.monotonic()
        self._last_step = -1
        # Steps retention keeps besides keep_last/keep_every: a trainer's own choice (the
        # best k of Lightning's ModelCheckpoint, integrations/lightning_steady.py). Replaced
        # whole, never mutated: the save thread reads it.
        self.pinned_steps: frozenset[int] = frozenset()
        self._cost_s: float | None = None
        self._durable_s = 0.0
        self.last_event: dict[str, Any] | None = None
        self.tokens_seen = 0  # from the restored checkpoint's COMMIT
        self._durable_ok = 0  # the newest step whose durable save committed in this process
        # The run's identity: set by Run before restore_latest; else, with the memory tier
        # on, established in the checkpoint directory at first use (_ensure_nonce).
        self.run_nonce: str | None = None
        self.memory: MemoryTier | None = None
        if cfg.memory.enabled:
            if cfg.memory.every_steps == "auto" and not cfg.mtbf_s:
                raise ConfigError(
                    'checkpoint.memory.every_steps = "auto" needs checkpoint.mtbf_s (the '
                    "job's mean time between failures, seconds) to choose K; or give K"
                )
            # Its own group, never the training one: transfers run in the tier's thread.
            side = dist.new_group(backend="gloo") if initialised else None
            self.memory = MemoryTier(cfg.memory, side, directory, self._job, cfg.mtbf_s)

    # -- when ---------------------------------------------------------------------------
    def interval_s(self) -> float | None:
        """The current time interval (``seconds``/``auto``), None before a measured save."""
        if self.interval == "seconds":
            return float(self.every_seconds)
        if self.interval == "auto" and self._cost_s is not None:
            return float(
                self._optimal(
                    self._cost_s, self.mtbf_s, restart_s=self.restart_s, durable_s=self._durable_s
                )
            )
        return None

    def _due(self, step: int) -> bool:
        if step <= self._last_step:
            return False
        if self.interval == "steps":
            return bool(self.every_steps) and step % self.every_steps == 0
        if self.group.rank == 0:
            iv = self.interval_s()
            due = iv is None or time.monotonic() - self._last_save_t >= iv
        else:
            due = False
        if self._decide is not None:  # every rank must take the same decision
            import torch
            import torch.distributed as dist

            flag = torch.tensor([1 if due else 0], dtype=torch.int32)
            dist.broadcast(flag, group=self._decide, group_src=0)
            due = bool(flag.item())
        return due

    def maybe_save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        """Save if the interval policy says so (and snapshot into memory when that tier's
        step is due); returns the seconds the caller was blocked."""
        self._deliver()
        block_s = 0.0
        if self.memory is not None and self.memory.due(step):
            if self.run_nonce is None:  # the tier's group is idle once its generation landed
                block_s += self.memory.wait()
                self._ensure_nonce(self.memory.group)
            self.memory.nonce = self.run_nonce
            block_s += self.memory.snapshot(step, states, tokens_seen=tokens_seen)
        if not self._due(step):
            return block_s
        return block_s + self.save(step, states, tokens_seen=tokens_seen)

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        """Snapshot ``states`` now and write it (in the background unless ``sync``)."""
        t0 = time.perf_counter()
        # the in-flight policy: wait for the previous save, counted as blocking (the memory
        # tier's generation in flight runs on: it has its own group and thread)
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._deliver()
        if self._fatal is not None:
            raise CheckpointError(self._fatal)
        self._ensure_nonce(self.group)  # no save in flight: the group is free
        if self._leases is None and not self._take_leases(step, t0):
            return time.perf_counter() - t0
        staged = self._stager.stage(S.dcp_state_dict(states))
        rank_json = {"step": step, "states": S.json_states(states), "rng": S.rng_state()}
        block_s = time.perf_counter() - t0
        req = SaveRequest(
            step=step,
            staged=staged,
            rank_json=rank_json,
            tokens_seen=tokens_seen,
            async_mode=self.async_mode,
            tensor_format=self.config.tensor_format,
            plans=self._plans,
            layout_version=self._stager.layout_version,
            block_s=block_s,
            t_start=t0,
            state_names=sorted(states),
            nbytes=self._stager.bytes_staged,
            daemon_restarts_left=self._daemon_restarts_left,
            job=self._job,
            run_nonce=self.run_nonce,
        )
        self._last_step, self._last_save_t = step, time.monotonic()
        if self.async_mode == "sync":
            self._results = self._run(req)
            self._deliver()
            return time.perf_counter() - t0
        self._thread = threading.Thread(
            target=lambda: setattr(self, "_results", self._run(req)),
            name=f"steadytrain-ckpt-{step}",
            daemon=True,
        )
        self._thread.start()
        return block_s

    def _take_leases(self, step: int, t0: float) -> bool:
        """Rank 0 takes the writer lease on every root this job writes; every rank learns the
        outcome. A live holder: ``CheckpointError`` on every rank. A store that does not
        answer: this save fails (an event), the next one tries again."""
        verdict: tuple[str, str] = ("ok", "")
        leases: list[Lease] = []
        if self.group.rank == 0:
            try:
                for root in [self.local] + ([self.remote] if self.remote is not None else []):
                    leases.append(
                        acquire(root.store, job=self._job, timeout_s=self.config.lease_timeout_s)
                    )
            except CheckpointError as exc:
                verdict = ("refused", str(exc))
            except (SteadyError, OSError) as exc:
                verdict = ("retry", f"{type(exc).__name__}: {exc}")
            if verdict[0] != "ok":
                for lease in leases:
                    lease.release()
                leases = []
        try:
            kind, message = self.group.broadcast(verdict)
        except FAILURES as exc:  # noqa: BLE001 - a broken group fails this save, not training
            kind, message = "retry", f"checkpoint group failed: {exc}"
        if kind == "refused":
            raise CheckpointError(message)
        if kind == "ok":
            self._leases = leases
            return True
        self._last_step, self._last_save_t = step, time.monotonic()
        error = f"taking the checkpoint writer lease failed ({message}); the next save retries"
        log.warning("checkpoint of step %d failed (training goes on): %s", step, error)
        elapsed = time.perf_counter() - t0
        self._results = [
            {
                "type": "checkpoint",
                "step": step,
                "block_s": elapsed,
                "durable_s": elapsed,
                "ok": False,
                "path": "",
                "error": error,
                "bytes": 0,
                **self._policy(),
            }
        ]
        self._deliver()
        return False

    def _fence(self) -> None:
        """Run by the writer on rank 0 before claiming a directory and before COMMIT: is the
        root still this job's? (``LeaseLostError`` if another job took it.)"""
        for lease in self._leases or []:
            lease.check()

    def _policy(self) -> dict[str, Any]:
        """The interval in force, on every checkpoint event: the alert engine's yardstick
        for "the recovery point is older than two intervals"."""
        every = self.every_steps if self.interval == "steps" else 0
        return {"every_steps": every, "interval_s": self.interval_s()}

    def _run(self, req: SaveRequest) -> list[dict[str, Any]]:
        hook = self.before_commit
        # A synchronous save runs inside maybe_save(step), before the loop records ``step``.
        through = req.step - 1 if req.async_mode == "sync" else req.step
        event = run_save(
            req,
            self.group,
            self.local,
            self.remote,
            self._in_flight,
            fence=self._fence,
            before_commit=None if hook is None else (lambda: hook(through)),
        )
        events = []
        daemon = event.pop("daemon", None)
        if daemon is not None:  # the same on every rank: all ranks switch together
            if daemon["action"] == "restart":
                self._daemon_restarts_left -= 1
            else:
                self.async_mode = "thread"
            events.append({"type": "checkpoint_daemon", "step": req.step, **daemon})
        if event.get("lease_lost"):
            self._fatal = str(event["error"])
        if event["ok"]:
            self._committed_here.append(os.path.basename(str(event["path"]).rstrip("/")))
            self._retain()
        self._in_flight[:] = []
        event.update(self._policy())
        return events + [event]

    @property
    def saving(self) -> bool:
        """True while a background save is in flight (Run's SIGTERM watcher waits for it)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Block until the in-flight save (if any) is durable and the memory generation in
        flight is written; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.memory is not None:
            self.memory.wait()
        self._deliver()
        return time.perf_counter() - t0

    def _deliver(self) -> None:
        """Report a finished save from the caller's thread (sinks need not be thread-safe)."""
        if self.memory is not None:
            for event in self.memory.take_events():
                self._emit(event)
        if self._thread is not None and self._thread.is_alive():
            return
        events, self._results = self._results, []
        for event in events:
            if event["type"] == "checkpoint" and event["ok"]:
                self._cost_s, self._durable_s = event["block_s"], event["durable_s"]
                self._durable_ok = max(self._durable_ok, int(event["step"]))
            self._emit(event)

    def _emit(self, event: dict[str, Any]) -> None:
        # last_event: the newest save or restore, which Run's final save reads as "what is
        # held"; a memory generation is not a durable commit and must not stand in for one
        if event.get("type") != "memory_snapshot":
            self.last_event = event
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a broken sink must not stop training
                log.exception("on_event callback failed for %s", event.get("type"))

    # -- retention -----------------------------------------------------------------------
    def _retain(self) -> None:
        """Keep the last K committed + every M-th step + the pinned steps; drop older partial
        directories."""
        roots = [self.local] if self.group.rank == 0 else []
        if self.remote is not None:
            roots = [self.local] + ([self.remote] if self.group.rank == 0 else [])
        for root in roots:
            try:
                infos = discover(root)
                committed = [i for i in infos if i.committed or i.name in self._committed_here]
                if not committed:
                    continue
                keep = {i.name for i in committed[: self.keep_last]}
                if self.keep_every:
                    keep |= {i.name for i in committed if i.step % self.keep_every == 0}
                pinned = self.pinned_steps
                keep |= {i.name for i in committed if i.step in pinned}
                newest = committed[0].key
                for i in infos:
                    if i.name in keep or i.name in self._in_flight or i.extra.get("foreign"):
                        continue  # foreign: a link out of the root; deleting it would reach out
                    if i.committed or i.name in self._committed_here or i.key < newest:
                        root.remove(i.name)
            except Exception as exc:  # noqa: BLE001 - retention retries after the next save
                log.warning("retention in %s failed: %s", root.url, exc)
        # Bounded: node-local staging copies beyond the last K are caches of the remote
        # copy (which keeps the milestones); forgetting them lets retention drop them.
        del self._committed_here[: -(self.keep_last + 1)]

    # -- restoring -----------------------------------------------------------------------
    def restore_latest(self, states: dict[str, Any]) -> int:
        """Load the newest good recovery point (a memory generation at least as new as the
        newest durable commit, else the newest committed checkpoint that verifies); returns
        its step (0: none)."""
        event, passed = self._restore_memory(states)
        nonce = self.run_nonce
        if event is None:
            event = _restore(states, self.group, self.local, self.remote, self.verify, nonce)
            event["skipped"] = passed + event["skipped"]
            if self.memory is not None and self.memory.touched and not event["step"]:
                raise CheckpointError(
                    "a memory snapshot failed while loading and no durable checkpoint could "
                    f"be restored over it ({passed[-1]['reason']}); restart the process"
                )
        self._restored(event)
        self._emit(event)
        return int(event["step"])

    def restore_memory(self, states: dict[str, Any]) -> tuple[dict[str, Any] | None, list]:
        """The memory tier's restore alone (collective on the tier's group): (the restore
        event, or None: no generation every rank holds; what was passed over). In-place
        recovery of FSDP2 shards uses it: there a durable restore is the whole restart's."""
        event, passed = self._restore_memory(states)
        if event is not None:
            self._restored(event)
        return event, passed

    def _restore_memory(self, states: dict[str, Any]) -> tuple[dict[str, Any] | None, list]:
        self.wait()
        self._ensure_nonce(self.group)
        if self.memory is None:
            return None, []
        nonce = self.run_nonce
        self.memory.nonce = nonce
        root = self.remote or self.local
        return self.memory.restore(states, lambda: newest_durable_step(root, nonce))

    def _restored(self, event: dict[str, Any]) -> None:
        if self.memory is not None:
            self.memory.forget_after(int(event["step"]))
            if event.get("tier", "durable") != "durable":  # held in memory only, so far
                self.memory.last_step = max(self.memory.last_step, int(event["step"]))
        if event["step"]:
            self._last_step = event["step"]
            self.tokens_seen = event["tokens_seen"]
        for s in event["skipped"]:
            log.warning("skipped checkpoint %s: %s", s["path"], s["reason"])

    # -- the run's identity ----------------------------------------------------------------
    def newest_run_nonce(self) -> str | None:
        """The ``run_nonce`` of the newest committed durable checkpoint (on ``remote`` when
        there is one, else local), or None (none, or it names no run). Cheap: one listing
        and one COMMIT read (more only past newer directories with no valid COMMIT). Run
        adopts it when its run directory holds no identity (run_identity.establish)."""
        manifest = newest_manifest(self.remote or self.local)
        nonce = (manifest or {}).get("run_nonce")
        return nonce if is_nonce(nonce) else None

    def _ensure_nonce(self, group: Group) -> None:
        """Without ``Run`` (``run_nonce`` unset) and with the memory tier on: the run's
        identity from this checkpoint directory (``run_identity.establish`` on rank 0,
        adopting the newest checkpoint's), broadcast over ``group`` (collective: every rank
        calls it at the same point, with ``group`` idle)."""
        if self.run_nonce is not None or self.memory is None:
            return
        nonce = None
        if group.rank == 0:
            try:
                nonce = establish(self.local.root, self.newest_run_nonce).nonce
            except (OSError, SteadyError) as exc:  # a directory it cannot write: this process
                nonce = new_nonce()
                log.warning(
                    "checkpoint directory %s: no run identity could be kept (%s); this "
                    "process's memory snapshots will not be restored after it ends",
                    self.local.root,
                    exc,
                )
        self.run_nonce = str(group.broadcast(nonce))

    def close(self, keep_memory: bool = False) -> None:
        """Wait for the in-flight save, release the writer lease (the next job on this root
        need not wait for it to age) and the staging buffers. ``keep_memory``: the memory
        tier's copies stay (an in-place regroup restores from them next)."""
        self.wait()
        leases, self._leases = self._leases or [], None
        for lease in leases:
            lease.release()
        self._stager.release()
        if self.memory is not None:
            # A clean end: the final durable save holds everything memory holds.
            remove = not keep_memory and self._durable_ok >= self.memory.last_step
            self.memory.close(remove=remove)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _planner() -> Callable[..., float]:
    try:
        from steadytrain.planning import optimal_interval_s
    except ImportError as exc:
        raise ConfigError(
            "interval='auto' needs steadytrain.planning.optimal_interval_s, which is not "
            f"available ({exc}); use every_steps= or every_seconds="
        ) from None
    return optimal_interval_s
