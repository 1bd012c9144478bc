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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.checkpoint.restore import restore_latest as _restore
from steadytrain.checkpoint.staging import Stager
from steadytrain.checkpoint.writer import Group, SaveRequest, run_save
from steadytrain.errors import ConfigError

__all__ = ["Checkpointer"]

log = logging.getLogger("steadytrain.checkpoint")
_MODES = ("sync", "thread", "process")


class Checkpointer:
    """Sharded, asynchronous DCP checkpoints with a COMMIT written last."""

    def __init__(
        self,
        directory: str,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        interval: str | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        async_mode: str = "thread",
        remote: str | None = None,
        process_group: Any = None,
        on_event: Callable[[dict], None] | None = None,
        *,
        mtbf_s: float | None = None,
        restart_s: float = 0.0,
        storage_options: dict[str, Any] | None = None,
        verify: str = "full",
    ) -> None:
        if interval is None:
            interval = "seconds" if every_seconds and not every_steps else "steps"
        if interval not in ("steps", "seconds", "auto"):
            raise ConfigError(f"interval={interval!r}: use 'steps', 'seconds' or 'auto'")
        if interval == "steps" and every_steps is not None and every_steps < 1:
            raise ConfigError(f"every_steps={every_steps}: must be >= 1 (or None: never)")
        if interval == "seconds" and not (every_seconds and every_seconds > 0):
            raise ConfigError("interval='seconds' needs every_seconds > 0")
        if interval == "auto":
            if not (mtbf_s and mtbf_s > 0):
                raise ConfigError("interval='auto' needs mtbf_s= (mean time between failures)")
            self._optimal = _planner()
        if verify not in ("full", "overlap"):
            raise ConfigError(f"verify={verify!r}: use 'full' or 'overlap' (see docs)")
        if async_mode not in _MODES:
            raise ConfigError(f"async_mode={async_mode!r}: use one of {_MODES}")
        if keep_last < 1:
            raise ConfigError(f"keep_last={keep_last}: keep at least the newest checkpoint")
        if keep_every is not None and keep_every < 1:
            raise ConfigError(f"keep_every={keep_every}: must be >= 1 or None")
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
        self.every_steps, self.every_seconds, self.interval = every_steps, every_seconds, interval
        self.keep_last, self.keep_every, self.async_mode = keep_last, keep_every, async_mode
        self.mtbf_s, self.restart_s = mtbf_s, restart_s
        self.on_event = on_event
        self.verify = verify
        self._stager = Stager(shared_memory=async_mode == "process")
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._in_flight: list[str] = []
        # Directories whose save this process saw commit. On nodes other than rank 0's, the
        # node-local staging copy has no COMMIT (rank 0 writes it), so retention there needs
        # this list to tell committed copies from torn ones.
        self._committed_here: list[str] = []
        self._last_save_t = time.monotonic()
        self._last_step = -1
        self._cost_s: float | None = None
        self._durable_s = 0.0
        self.last_event: dict[str, Any] | None = None
        self.tokens_seen = 0  # from the restored checkpoint's COMMIT

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
        """Save if the interval policy says so; returns the seconds the caller was blocked."""
        self._deliver()
        if not self._due(step):
            return 0.0
        return self.save(step, states, tokens_seen=tokens_seen)

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        """Snapshot ``states`` now and write it (in the background unless ``sync``)."""
        t0 = time.perf_counter()
        self.wait()  # the in-flight policy: wait for the previous save, counted as blocking
        staged = self._stager.stage(S.dcp_state_dict(states))
        rank_json = {"step": step, "states": S.json_states(states), "rng": S.rng_state()}
        block_s = time.perf_counter() - t0
        req = SaveRequest(
            step=step,
            staged=staged,
            rank_json=rank_json,
            tokens_seen=tokens_seen,
            async_mode=self.async_mode,
            block_s=block_s,
            t_start=t0,
            state_names=sorted(states),
            nbytes=self._stager.bytes_staged,
        )
        self._last_step, self._last_save_t = step, time.monotonic()
        if self.async_mode == "sync":
            self._result = self._run(req)
            self._deliver()
            return time.perf_counter() - t0
        self._thread = threading.Thread(
            target=lambda: setattr(self, "_result", self._run(req)),
            name=f"steadytrain-ckpt-{step}",
            daemon=True,
        )
        self._thread.start()
        return block_s

    def _run(self, req: SaveRequest) -> dict[str, Any]:
        event = run_save(req, self.group, self.local, self.remote, self._in_flight)
        if event["ok"]:
            self._committed_here.append(os.path.basename(str(event["path"]).rstrip("/")))
            self._retain()
        self._in_flight[:] = []
        return event

    def wait(self) -> float:
        """Block until the in-flight save (if any) is durable; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._deliver()
        return time.perf_counter() - t0

    def _deliver(self) -> None:
        """Report a finished save from the caller's thread (sinks need not be thread-safe)."""
        if self._thread is not None and self._thread.is_alive():
            return
        event, self._result = self._result, None
        if event is None:
            return
        if event["ok"]:
            self._cost_s, self._durable_s = event["block_s"], event["durable_s"]
        self._emit(event)

    def _emit(self, event: dict[str, Any]) -> None:
        self.last_event = event
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a broken sink must not stop training
                log.exception("on_event callback failed for %s", event.get("type"))

    # -- retention -----------------------------------------------------------------------
    def _retain(self) -> None:
        """Keep the last K committed + every M-th step; drop older partial directories."""
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
                newest = committed[0].key
                for i in infos:
                    if i.name in keep or i.name in self._in_flight:
                        continue
                    if i.committed or i.name in self._committed_here or i.key < newest:
                        root.remove(i.name)
            except Exception as exc:  # noqa: BLE001 - retention retries after the next save
                log.warning("retention in %s failed: %s", root.url, exc)
        # Bounded: node-local staging copies beyond the last K are caches of the remote
        # copy (which keeps the milestones); forgetting them lets retention drop them.
        del self._committed_here[: -(self.keep_last + 1)]

    # -- restoring -----------------------------------------------------------------------
    def restore_latest(self, states: dict[str, Any]) -> int:
        """Load the newest committed checkpoint that verifies; returns its step (0: none)."""
        self.wait()
        event = _restore(states, self.group, self.local, self.remote, self.verify)
        if event["step"]:
            self._last_step = event["step"]
            self.tokens_seen = event["tokens_seen"]
        for s in event["skipped"]:
            log.warning("skipped checkpoint %s: %s", s["path"], s["reason"])
        self._emit(event)
        return int(event["step"])

    def close(self) -> None:
        """Wait for the in-flight save and release the staging buffers."""
        self.wait()
        self._stager.release()

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
