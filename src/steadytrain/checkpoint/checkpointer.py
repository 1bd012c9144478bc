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

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.checkpoint.restore import restore_latest as _restore
from steadytrain.checkpoint.staging import Stager
from steadytrain.checkpoint.writer import Group, SaveRequest, run_save
from steadytrain.errors import ConfigError
from steadytrain.settings import check, check_choices, merge

__all__ = ["Checkpointer", "CheckpointerConfig"]

log = logging.getLogger("steadytrain.checkpoint")


@dataclasses.dataclass(kw_only=True)
class CheckpointerConfig:
    """Everything a ``Checkpointer`` can be told, with the one copy of each default and
    check. The ``[checkpoint]`` table of a training config is this plus ``dir``/``engine``."""

    every_steps: int = 0  # save when step % every_steps == 0 (0: not by steps)
    every_seconds: float = 0.0  # save after this much wall time (0: not by time)
    # None: "seconds" when only every_seconds is set, else "steps" (0 steps: call save()).
    # "auto": the planner's optimum from the measured save cost and mtbf_s.
    interval: Literal["steps", "seconds", "auto"] | None = None
    # At least 2, never 1: a checkpoint can be found damaged after its commit (a bad disk, a
    # truncated copy), and restore then falls back to the next older committed one. With
    # keep_last = 1 there is none, and one bad file sends the job back to step 0.
    keep_last: int = 3
    keep_every: int = 0  # also keep every step that is a multiple of this (0: none)
    async_mode: Literal["sync", "thread", "process"] = "thread"
    remote: str = ""  # an s3://... copy of every committed checkpoint ("": none)
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # for remote
    mtbf_s: float = 0.0  # the job's mean time between failures, for interval = "auto"
    restart_s: float = 0.0  # the job's restart cost, for interval = "auto"
    # "full", the safe one: every checksum is checked before any live tensor is written, so
    # a damaged checkpoint never touches the caller's state, whatever that state is (a
    # restore into a live model too). "overlap" hashes while the bytes stream into place
    # (one read, faster) and is only safe onto freshly built state: the packaged training
    # configs choose it explicitly because the loop restores at start-up.
    verify: Literal["full", "overlap"] = "full"

    def __post_init__(self) -> None:
        check_choices(self)
        if self.interval is None:
            only_time = self.every_seconds and not self.every_steps
            self.interval = "seconds" if only_time else "steps"
        check(self.every_steps >= 0, "every_steps", self.every_steps, "use 0 (off) or more")
        check(self.every_seconds >= 0, "every_seconds", self.every_seconds, "use 0 (off) or more")
        if self.interval == "seconds":
            check(
                self.every_seconds > 0,
                "every_seconds",
                self.every_seconds,
                'set it (> 0) with interval = "seconds"',
            )
        if self.interval == "auto":
            check(
                self.mtbf_s > 0,
                "mtbf_s",
                self.mtbf_s,
                'set the mean time between failures (seconds) with interval = "auto"',
            )
        check(self.mtbf_s >= 0, "mtbf_s", self.mtbf_s, "use 0 (unknown) or more")
        check(self.restart_s >= 0, "restart_s", self.restart_s, "use 0 or more seconds")
        check(
            self.keep_last >= 2,
            "keep_last",
            self.keep_last,
            "keep at least 2: restore falls back to the previous checkpoint when the newest "
            "one turns out damaged",
        )
        check(self.keep_every >= 0, "keep_every", self.keep_every, "use 0 (off) or a step count")
        check(
            isinstance(self.storage_options, dict),
            "storage_options",
            self.storage_options,
            "give a table (dict) of fsspec options, e.g. {endpoint_url = ...}",
        )


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
        *,
        mtbf_s: float | None = None,
        restart_s: float | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: str | None = None,
        config: CheckpointerConfig | None = None,
    ) -> None:
        """``config=`` or keywords (a keyword given wins over ``config``); every default
        lives in ``CheckpointerConfig``. ``process_group`` and ``on_event`` are runtime
        objects, not settings."""
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
        self.verify = cfg.verify
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
