"""What a trainer callback needs around ``steadytrain.Run`` (used by ``integrations/hf.py``).

A callback opens the ``Run`` in one hook and closes it in another, so it cannot hold it in a
``with``; two things stand in for the ``with`` here:

- ``TrainerSaves``: Run's ``checkpoint=`` for a trainer that checkpoints itself. It saves
  nothing; it tells Run the step the trainer restored (Run's ``start_step``), and hands the
  trainer's own saves to Run as checkpoint events whose blocking time goes into the step
  record (``checkpoint_block_s``), exactly as a steadytrain save would.
- ``record_failed_start``: the attempt of a trainer that failed before the callback's Run
  opened (Lightning's ``setup`` or sanity check), so the report still shows it and why.
- ``ExitGuard``: closes the Run as a crash when the process leaves without the trainer's
  end hook: an uncaught exception (``sys.excepthook``: a gloo "Connection reset by peer"
  after a peer died, an OOM), SIGTERM (torchrun stopping the survivors, preemption: Run
  turns it into ``Terminated``, a ``SystemExit``, which only ``atexit`` sees), or any other
  exit while training (``atexit``). Without it the meter's own exit hook would write the
  clean ``interpreter_exit`` and the report would show no crash (issue 27).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from steadytrain.monitor.meter import GoodputMeter
from steadytrain.run import PROCESS_START
from steadytrain.run_identity import establish as establish_identity
from steadytrain.run_lease import lease_settings, take_run_lease
from steadytrain.run_support import Terminated, crash_reason, meter_config, say

__all__ = ["CallbackState", "ExitGuard", "TrainerSaves", "record_failed_start"]


class CallbackState:
    """What both trainer callbacks are given and hold (``hf.py``, ``lightning.py``).

    ``run_dir``: where the ledger goes (None: a ``steadytrain`` folder in the trainer's own
    output directory). ``tokens_per_step``: tokens of one optimizer step over all ranks (None:
    each callback works it out, see its docstring). ``monitor``, ``config``, ``device``,
    ``backend_timeout_s``: as ``steadytrain.Run``. The trainer-specific hooks live in each
    callback; this base keeps the settings and the open ``Run``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        tokens_per_step: int | None = None,
        monitor: Any = None,
        config: dict[str, Any] | None = None,
        device: str | None = None,
        backend_timeout_s: float | None = None,
    ) -> None:
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.tokens_per_step = tokens_per_step
        self._run_kw = {
            "monitor": monitor,
            "config": config,
            "device": device,
            "backend_timeout_s": backend_timeout_s,
        }
        self.run: Any = None  # the open steadytrain.Run, between train start and end
        self._owner_run: Any = None  # a Run its owner opens and closes (``attach``)
        self._saves: TrainerSaves | None = None
        self._guard: ExitGuard | None = None
        self._phase: Any = None
        self._pending: dict[str, Any] | None = None
        self._init_trainer_state()

    def _init_trainer_state(self) -> None:
        """A callback's own per-step state (its timers and counters)."""

    def _now(self, run: Any = None) -> float:
        """The callbacks' one clock: the Run's, which stops inside the ``eval`` phase
        (``Run.clock``), so a data wait or a save timed across the Trainer's evaluation holds
        none of it (issue 42); before a Run opens, ``perf_counter`` (the same until then)."""
        run = run if run is not None else self.run
        return run.clock() if run is not None else time.perf_counter()

    def attach(self, run: Any) -> None:
        """Record into ``run`` from the next train start on, instead of opening a Run with
        ``TrainerSaves``: its owner (the steadytrain strategy or Trainer, which save through
        ``run.save`` and restore through its checkpointer) opens and closes it; a save's
        blocked time is ``run.save``'s, not this callback's wall clock."""
        self._owner_run = run

    def _take_owner_run(self) -> bool:
        """At train start: use the owner's Run (True), or open one (False)."""
        if self._owner_run is None:
            return False
        self.run, self._saves = self._owner_run, None
        return True

    def pending_tokens(self) -> int:
        """Tokens of the step that ended and is not recorded yet (0: none): what a save of
        that step adds to ``run.tokens_seen``."""
        return int(self._pending["tokens"]) if self._pending else 0

    def _release(self, run: Any, exc: BaseException | None) -> None:
        """End this callback's part of ``run``: leave it to its owner, or close it."""
        if self._guard is not None:
            self._guard.uninstall()
        if run is not self._owner_run:
            run.__exit__(None if exc is None else type(exc), exc, None)


class TrainerSaves:
    """A ``checkpoint=`` for ``Run`` when the trainer saves and restores by itself.

    ``restored_step``/``restored_path``: what the trainer loaded before the callback's Run
    opened. Its load is part of the start-up (it happened before ``job_start``), so the
    ``restore`` record says ``tier: "trainer"`` and the report's Restores table "in
    start-up", not a durable restore of 0 s. ``restored_step=None``: not known (the trainer
    failed before it restored): no ``restore`` record, and Run keeps the ledger's position.
    ``saved(step, block_s, path)`` after each of the trainer's saves; Run's next
    ``step_done`` picks it up through ``maybe_save``."""

    TIER = "trainer"  # the restore record's tier: loaded by the trainer, inside start-up

    def __init__(self, restored_step: int | None = 0, restored_path: str = "") -> None:
        self.restored_step = None if restored_step is None else int(restored_step)
        self.restored_path = restored_path
        self.on_event: Callable[[dict[str, Any]], None] | None = None
        self.last_event: dict[str, Any] | None = None
        self.tokens_seen = 0
        self._saved: dict[str, Any] | None = None

    def restore_latest(self, _states: dict[str, Any]) -> int | None:
        if self.restored_step is None:
            return None
        self._emit(
            {
                "type": "restore",
                "step": self.restored_step,
                "restore_s": 0.0,  # in the start-up (its tier says so)
                "tier": self.TIER,
                "path": self.restored_path,
                "skipped": [],
                "tokens_seen": 0,
                "changes": [],
            }
        )
        return self.restored_step

    def saved(self, step: int, block_s: float, path: str) -> None:
        """The trainer committed ``step`` to ``path``; the loop waited ``block_s`` for it."""
        block_s = max(0.0, float(block_s))
        self._saved = {
            "type": "checkpoint",
            "step": int(step),
            "block_s": block_s,
            "durable_s": block_s,  # a synchronous save: durable when it returns
            "ok": True,
            "path": path,
            "error": None,
        }

    def maybe_save(self, _step: int, _states: dict[str, Any], **_kw: Any) -> float:
        ev, self._saved = self._saved, None
        if ev is None:
            return 0.0
        self._emit(ev)
        return ev["block_s"]

    def save(self, *_a: Any, **_kw: Any) -> None:
        """The trainer's own policy decides its final save: nothing to do here."""

    def wait(self) -> float:
        return 0.0

    def close(self) -> None:
        pass

    def _emit(self, ev: dict[str, Any]) -> None:
        if ev["type"] == "checkpoint":
            self.last_event = ev
        if self.on_event is not None:
            self.on_event(ev)


class ExitGuard:
    """Calls ``close(exc)`` once if the process leaves while installed (module docstring).
    ``exc``: the uncaught exception, ``Terminated`` for SIGTERM, else a ``RuntimeError``
    saying the trainer never reached its end hook. ``uninstall()`` after a clean close."""

    def __init__(self, close: Callable[[BaseException | None], None], what: str) -> None:
        self._close, self._what = close, what
        self._prev_hook: Any = None
        self._prev_term: Any = None
        self.signum: int | None = None
        self.installed = False

    def install(self) -> None:
        """After ``Run.__enter__`` (its SIGTERM handler is the one wrapped here)."""
        self._prev_hook, sys.excepthook = sys.excepthook, self._excepthook
        atexit.register(self._atexit)  # after the meter's hook: runs before it (LIFO)
        if threading.current_thread() is threading.main_thread():
            prev = signal.getsignal(signal.SIGTERM)
            if callable(prev):  # Run's (or a framework's) handler: note the signal first
                self._prev_term = prev
                signal.signal(signal.SIGTERM, self._sigterm)
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        self.installed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook
        atexit.unregister(self._atexit)
        if self._prev_term is not None and signal.getsignal(signal.SIGTERM) == self._sigterm:
            signal.signal(signal.SIGTERM, self._prev_term)

    def _fire(self, exc: BaseException) -> None:
        if self.installed:
            self.uninstall()
            self._close(exc)

    def _excepthook(self, exc_type: Any, exc: BaseException, tb: Any) -> None:
        (self._prev_hook or sys.__excepthook__)(exc_type, exc, tb)  # the traceback first
        self._fire(exc)

    def _sigterm(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self._prev_term(signum, frame)  # Run's: raises Terminated, which atexit sees

    def _atexit(self) -> None:
        if self.signum is not None:
            self._fire(Terminated(self.signum))
        else:
            self._fire(RuntimeError(f"the process exited before {self._what}"))


def record_failed_start(
    run_dir: str, rank: int, world_size: int, exc: BaseException, run_kw: dict[str, Any]
) -> None:
    """Record the attempt of a trainer that failed before its callback opened the ``Run``
    (Lightning's ``setup`` or sanity check, before ``on_train_start``): a ``job_start`` and
    the crash's ``job_end`` in rank 0's ledger, so the report lists the attempt and its
    reason (issue 42: such a crash left no ledger at all). ``run_kw``: the callback's
    ``monitor``/``config``/``device``.

    Not through ``Run``: its entry is collective (the lease verdict, the attempt id) and
    after a failure the other ranks may be anywhere, so rank 0 alone records, under the run
    lease taken without a collective (another live job's directory gets nothing). The
    restore point is unknown: ``job_start`` keeps the ledger's own position, so nothing is
    charged as redone here (the attempt that does restore charges it). The start-up is the
    process's whole life so far. Never raises: the trainer's exception is what matters."""
    if rank != 0:
        return
    try:
        os.makedirs(run_dir, exist_ok=True)
        job, timeout_s = lease_settings(None)
        lease = take_run_lease(run_dir, 0, job=job, timeout_s=timeout_s, say=say, share=False)
    except Exception as e:  # noqa: BLE001 - another live job holds RUN_DIR: nothing there
        say(f"warning: the failed start is not recorded in {run_dir} ({e})")
        return
    try:
        meter = GoodputMeter(
            run_dir, rank=0, world_size=world_size, config=meter_config(run_kw.get("monitor"))
        )
        try:
            meter.job_start(
                restored_step=meter.position,
                startup_s=max(0.0, time.time() - PROCESS_START),
                config=run_kw.get("config"),
                device=run_kw.get("device"),
                run_nonce=establish_identity(run_dir).nonce,
                restore_unknown=True,
            )
        finally:
            meter.close(crash_reason(exc))
    except Exception as e:  # noqa: BLE001 - recording is best effort on a failure path
        say(f"warning: the failed start could not be recorded in {run_dir} ({e})")
    finally:
        if lease is not None:
            lease.release()
