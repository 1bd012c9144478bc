"""Hang watchdog: no progress for too long is a failure, recorded with stacks and restarted.

A rank that hangs in (or before) a collective is otherwise noticed only when the backend's
timeout expires (gloo 30 min, NCCL 10 min), and every other accelerator waits that long.
Liveness comes from the training loop itself (``beat(step)`` after every step), not from a
side thread: a thread heartbeat keeps beating through a livelocked loop. ``steadytrain.Run``
makes one per rank and beats it in ``step_done``; by hand:

    wd = HangWatchdog(run_dir, rank, world, attempt=a, meter=meter, config=cfg.watchdog,
                      nonce=run_nonce)
    for step in ...:
        with wd.phase("checkpoint"):       # a legitimately long phase: its own deadline
            ckpt.maybe_save(step, states)
        if step % 1000 == 0:
            with wd.phase("eval"):         # phases nest; any identifier is a phase name
                evaluate(model)
        wd.beat(step)                      # two attribute stores and a deque append
    wd.close()

Deadlines (``WatchdogConfig``, watchdog_config.py): ``init_s`` until ``warmup_steps`` steps
of this attempt are done, ``max(k x p99 step time, floor_s)`` after, and inside declared
phases the longest of the open phases' own (``phases.<name>_s``, else ``checkpoint_s``,
never less than outside them). Phases nest: leaving one puts the one around it back in
force, and counts as progress. A daemon thread polls every ``poll_s``.

A declared phase sets the deadline of the whole job (phases.py): the watchdog thread
publishes the phase its rank has been in for a poll, and a rank whose own deadline passed
reads the other ranks' before it fires: while another rank is inside a declared phase whose
deadline has not passed, or left one less than this rank's deadline ago, it waits. A rank
so held joins at once when another rank of its attempt fired (a verdict is on disk).

On a hang every rank's own watchdog fires (the others block in a collective, so they stall
too) and, each bounded in time:

1. dumps all its Python thread stacks (``faulthandler``) to
   ``RUN_DIR/hangs/attempt-{A}/rank-{R}.txt``;
2. publishes its verdict ``rank-{R}.json``: step, phase, seconds since progress, the loop
   thread's innermost frame, whether that frame waits in a collective (``waiting``) or not
   (``stuck``), and the other rank's declared phase that held it (``held_by``), if one did;
3. waits up to ``grace_s`` for the other ranks' verdicts and decides the culprits
   (``decide``): ranks that are not waiting, and ranks that never answered (SIGSTOPped, node
   gone); when every rank waits, the ranks behind the others, else all of them; publishes
   that decision ``decision-{R}.json`` with the run's nonce (for the reapers, below);
4. rank 0 appends a ``hang`` record to the ledger through the meter and publishes
   ``recorded.json``; the other ranks wait for that file (bounded) so torchrun does
   not kill rank 0 before the record is on disk -- unless rank 0 never answered;
5. exits with ``HANG_EXIT_CODE`` through ``os._exit``: a graceful shutdown can deadlock on
   the very collective that hangs. torchrun then restarts the job.

A rank that cannot do any of this -- SIGSTOPped (every thread stops, this one too), or its
watchdog thread unable to run -- would keep torchrun waiting out its SIGTERM grace (30 s) on
a stopped process. So with two or more ranks the watchdog also starts the rank's **reaper**
(reaper.py, ``reaper=True``): a child process on the same node, which a stopped parent does
not stop. Once a decision of this job (owned by this user, carrying the run's nonce, naming
ranks of the job) names its rank silent, or its rank is stopped, it SIGKILLs the rank (after
``recorded.json``, bounded) and publishes ``reaped-rank-{R}.json``; a rank that answered is
left to its own exit (killed only as a backstop). ``close`` ends the reaper; so does the
rank's death.

If rank 0 could not write the record (it was the stuck one), the next attempt's rank 0 does,
from the verdict files, marked ``recovered`` (``recover_hang_records``); ``recorded.json``
makes that happen once. The verdict logic and the record live in hangs.py. The exchange
goes through RUN_DIR, which every rank already shares (ledgers, traces); a rank that cannot
reach it counts as "no response".
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadytrain.monitor.appender import open_regular
from steadytrain.monitor.hangs import (
    RECORDED,
    STACK_FRAMES,
    classify_stack,
    decide,
    hang_dir,
    hang_record,
    publish_decision,
    read_stopped,
    read_verdicts,
    recover_hang_records,
    thread_frames,
    where,
)
from steadytrain.monitor.phases import PhaseBoard
from steadytrain.monitor.reaper import spawn as spawn_reaper
from steadytrain.monitor.watchdog_config import (
    WatchdogConfig,
    backend_timeout_s,
    check_phase_name,
    p99,
)
from steadytrain.node import node_name
from steadytrain.storage.publish import publish_bytes

__all__ = [
    "HANG_EXIT_CODE",
    "HangWatchdog",
    "WatchdogConfig",
    "backend_timeout_s",
    "p99",
    "recover_hang_records",
]

log = logging.getLogger("steadytrain.monitor")

HANG_EXIT_CODE = 124  # "timed out" (coreutils timeout's code): torchrun restarts on any != 0


class _Phase:
    """``with wd.phase("eval"):`` -- a plain class: cheaper than contextlib. Entering pushes
    it on the watchdog's stack of open phases, leaving removes it (the phase around it is in
    force again) and counts as progress: the loop thread's whole cost, no I/O."""

    __slots__ = ("wd", "name", "t")

    def __init__(self, wd: HangWatchdog, name: str) -> None:
        self.wd, self.name, self.t = wd, name, 0.0

    def __enter__(self) -> None:
        self.t = time.monotonic()
        self.wd._open.append(self)

    def __exit__(self, *_exc: Any) -> None:
        wd, stack = self.wd, self.wd._open
        if stack and stack[-1] is self:
            stack.pop()
        else:  # left out of order (a trainer callback's phases): this one goes, the rest stay
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self:
                    del stack[i]
                    break
        wd._skip = True  # the next step time spans this phase: not a step time sample
        wd._t = wd._left = time.monotonic()  # leaving the phase is progress


class HangWatchdog:
    """One per rank; ``beat`` after every step. See the module docstring. ``nonce``: the
    run's (``Run.nonce``), carried by this rank's verdicts, decisions and phase records;
    its reaper acts only on decisions that carry it."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int = 0,
        world_size: int = 1,
        *,
        attempt: int = 0,
        meter: Any = None,
        config: WatchdogConfig | None = None,
        backend_timeout_s: float | None = None,
        nonce: str | None = None,
        in_place: bool = False,
        exit: Callable[[int], Any] = os._exit,  # noqa: A002 - tests pass a stub
    ) -> None:
        self.config = cfg = config or WatchdogConfig()
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.attempt, self.meter, self._exit = attempt, meter, exit
        self.nonce = nonce or ""
        self.in_place = in_place
        # A spared rank (in_place) waits this long to be closed before it exits after all.
        self.hold_s = 2 * cfg.grace_s + 10
        self.spared: dict[str, Any] | None = None  # the decision that spared this rank
        self.node = node_name()
        self._loop_ident = threading.get_ident()  # the thread that beats: the loop's
        self._t = self._left = time.monotonic()
        self._step = 0
        self._beats = 0
        self._open: list[_Phase] = []  # the declared phases open now, outermost first
        self._names: set[str] = set()  # phase names already checked
        self._skip = False
        self._intervals: deque[float] = deque(maxlen=cfg.window)
        self._stop = threading.Event()
        self.fired: dict[str, Any] | None = None  # this rank's verdict, once it fired
        # The job-wide rule (phases.py): only with other ranks to hold or be held by.
        self._board = PhaseBoard(run_dir, rank, world_size, attempt, self.nonce, cfg)
        self._board_on = world_size > 1
        limit = cfg.longest_static_s + 2 * cfg.grace_s
        if cfg.enabled and backend_timeout_s is not None and limit >= backend_timeout_s:
            log.warning(
                "monitor.watchdog: deadlines up to %.0fs (+ grace) reach the backend's "
                "collective timeout %.0fs: the backend fires first, without stacks; lower "
                "init_s/checkpoint_s/phases or pass a longer timeout to init_process_group",
                cfg.longest_static_s,
                backend_timeout_s,
            )
        self._thread: threading.Thread | None = None
        self.reaper = self._start_reaper() if cfg.enabled and cfg.reaper else None
        if cfg.enabled:
            self._thread = threading.Thread(target=self._run, name="steadytrain-watchdog")
            self._thread.daemon = True  # never keeps a finished process alive
            self._thread.start()

    # -- the loop's hot path ---------------------------------------------------------------
    def beat(self, step: int) -> None:
        """Step ``step`` is done (call on every rank, after every step)."""
        now = time.monotonic()
        if self._beats and not self._skip:
            self._intervals.append(now - self._t)
        self._skip = False
        self._t = now
        self._step = step
        self._beats += 1

    def phase(self, name: str) -> _Phase:
        """A context for a legitimately long part of the loop (``"checkpoint"``, ``"eval"``,
        any identifier): its own deadline (``phases.<name>_s``, else ``checkpoint_s``),
        for every rank of the job while this one is inside it. Phases nest."""
        if name not in self._names:
            check_phase_name(name)
            self._names.add(name)
        return _Phase(self, name)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.poll_s + 1)
        # The others must not wait for a phase of a closed rank.
        self._board.close(time.monotonic() if self._open else self._left)
        proc, self.reaper = self.reaper, None
        if proc is not None:  # never outlives a closed watchdog (it would outlive us briefly)
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def _start_reaper(self) -> subprocess.Popen[bytes] | None:
        """This rank's reaper (reaper.py); only with other ranks: they decide the hang."""
        if self.world_size < 2:
            return None
        cfg = self.config
        try:
            return spawn_reaper(
                hang_dir(self.run_dir, self.attempt),
                rank=self.rank,
                node=self.node,
                attempt=self.attempt,
                world_size=self.world_size,
                nonce=self.nonce,
                poll_s=min(0.25, cfg.poll_s),
                idle_s=cfg.poll_s,
                record_wait_s=2 * cfg.grace_s,  # what the other ranks wait for the record
                backstop_s=3 * cfg.grace_s + 10,  # our own exit path's bound, and then some
            )
        except Exception as e:  # never a reason not to train: the restart is only slower
            log.warning("hang watchdog: no reaper for rank %d (%s)", self.rank, e)
            return None

    def __enter__(self) -> HangWatchdog:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    # -- the daemon thread -----------------------------------------------------------------
    def check(self, now: float | None = None) -> dict[str, Any] | None:
        """The hang this rank sees now (step, phase, the open phases, seconds since
        progress, deadline) or None; another rank's declared phase is ``poll``'s concern."""
        now = time.monotonic() if now is None else now
        t, step = self._t, self._step
        open_ = list(self._open)
        p = p99(list(self._intervals))
        name, limit = self._deadline(open_, p)
        since = now - t
        if since <= limit:
            return None
        return {
            "step": step,
            "phase": name,
            "phases": [ph.name for ph in open_],
            "since_progress_s": since,
            "deadline_s": limit,
            "p99_step_s": p,
        }

    def _deadline(self, open_: list[_Phase], p: float | None) -> tuple[str, float]:
        """(the phase whose deadline is in force, that deadline): the longest of the open
        phases' and the implicit one's (``init`` or ``step``); the innermost of equals."""
        name = "init" if self._beats < self.config.warmup_steps else "step"
        limit = self.config.deadline(name, p)
        for ph in reversed(open_):
            d = self.config.deadline(ph.name, p)
            if d > limit:
                name, limit = ph.name, d
        return name, limit

    def poll(self, now: float | None = None) -> dict[str, Any] | None:
        """One look of the daemon thread: publish this rank's declared phase (when it
        changed), then the hang to act on now, or None: none, or one that another rank's
        declared phase still holds (phases.py)."""
        now = time.monotonic() if now is None else now
        if self._board_on:
            self._show_phase(now)
        seen = self.check(now)
        if seen is None or (self._board_on and self._board.holds(now, self._t, seen)):
            return None
        return seen

    def _show_phase(self, now: float) -> None:
        """Publish the phase this rank has been in for a poll, or that it left it."""
        open_ = list(self._open)
        if open_ and now - open_[0].t >= self.config.poll_s:
            name, limit = self._deadline(open_, p99(list(self._intervals)))
            phases = [ph.name for ph in open_]
            self._board.show(id(open_[0]), open_[0].t, name, phases, self._t, limit)
        else:
            self._board.close(self._left)

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            seen = self.poll()
            if seen is not None:
                self._handle(seen)
                return

    def _handle(self, seen: dict[str, Any]) -> None:
        cfg = self.config
        # Backstop: if anything below blocks (a full disk, a stuck flush), faulthandler's own
        # C thread dumps the stacks to stderr and exits after this long.
        faulthandler.dump_traceback_later(3 * cfg.grace_s + 30, exit=True)
        decision = None
        try:
            decision = self._report(seen)
        except Exception:
            log.exception("hang watchdog: reporting failed; exiting anyway")
        if decision is not None and self._spare(decision):
            return  # closed: the loop recovered in place
        faulthandler.dump_traceback_later(30, exit=True)  # the exit path's own backstop
        try:
            print(
                f"[watchdog] rank {self.rank}: exiting {HANG_EXIT_CODE} so the job restarts",
                file=sys.stderr,
                flush=True,
            )
        finally:
            self._exit(HANG_EXIT_CODE)
            faulthandler.cancel_dump_traceback_later()  # reached only with a test's stub

    def _spare(self, decision: dict[str, Any]) -> bool:
        """In-place recovery (``in_place``): a rank the decision does not name waits in a
        collective on the named ones. Their reapers kill them (a stopped rank at once), its
        collective then raises (gloo: the dead peer's socket closes) and ``Recovery``
        regroups with their replacements, after which the loop closes this watchdog. True
        when that happened within ``hold_s``; False: exit after all (the whole restart)."""
        if not self.in_place or self.rank in decision["stuck_ranks"]:
            return False
        self.spared = decision
        faulthandler.cancel_dump_traceback_later()  # waiting here is no hang of the report
        print(
            f"[watchdog] rank {self.rank}: not exiting: in-place recovery replaces rank(s) "
            f"{decision['stuck_ranks']} (waiting up to {self.hold_s:.0f}s for the regroup)",
            file=sys.stderr,
            flush=True,
        )
        return self._stop.wait(self.hold_s)

    def _report(self, seen: dict[str, Any]) -> dict[str, Any]:
        cfg, d = self.config, hang_dir(self.run_dir, self.attempt)
        d.mkdir(parents=True, exist_ok=True)
        detect_t = time.time()
        frames = thread_frames(self._loop_ident)
        state, frame, waiting_in = classify_stack(frames)
        held_by = self._board.held_by(self._t)  # another rank's phase this rank waited out
        verdict = {
            "rank": self.rank,
            "node": self.node,
            "pid": os.getpid(),
            "attempt": self.attempt,
            "world_size": self.world_size,
            **seen,
            "detect_t": detect_t,
            "progress_t": detect_t - seen["since_progress_s"],
            "frame": frame,
            "state": state,
            "waiting_in": waiting_in,
            "stack": [where(*f) for f in frames[:STACK_FRAMES]],
            "held_by": held_by,
            "nonce": self.nonce,
        }
        self.fired = verdict
        txt = d / f"rank-{self.rank}.txt"
        try:  # never through a symlink, never into a FIFO; a full disk skips only the stacks
            with os.fdopen(open_regular(txt, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
                f.write(
                    f"# rank {self.rank} on {self.node}, pid {os.getpid()}: no progress for "
                    f"{seen['since_progress_s']:.1f}s after step {seen['step']} "
                    f"({seen['phase']}, deadline {seen['deadline_s']:.1f}s)\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            log.warning("hang watchdog: %s not written (%s); stacks follow on stderr", txt, e)
            faulthandler.dump_traceback(all_threads=True)
        publish_bytes(str(d / f"rank-{self.rank}.json"), json.dumps(verdict))
        print(
            f"[watchdog] rank {self.rank}: no progress for {seen['since_progress_s']:.1f}s "
            f"after step {seen['step']} ({seen['phase']})"
            + (
                f", after rank {held_by['rank']}'s {held_by['phase']!r} phase deadline"
                if held_by
                else ""
            )
            + f"; {state} at {frame}; stacks in {d}",
            file=sys.stderr,
            flush=True,
        )
        until = time.monotonic() + cfg.grace_s
        nonce = self.nonce or None  # none given (a watchdog made by hand): not checked
        mine = {"rejects": self._board.rejects, "nonce": nonce, "world_size": self.world_size}

        def answered() -> int:  # a stopped rank's reaper answers for it (reaper.py)
            stopped = read_stopped(d, nonce=nonce, world_size=self.world_size)
            return len(verdicts.keys() | stopped)

        verdicts = read_verdicts(d, **mine)
        while answered() < self.world_size and time.monotonic() < until:
            time.sleep(min(0.05, cfg.poll_s))
            verdicts = read_verdicts(d, **mine)
        decision = decide(verdicts, self.world_size)
        try:  # the reapers (reaper.py) kill the silent ranks from it
            publish_decision(d, self.rank, self.attempt, decision, self.nonce)
        except OSError as e:
            log.warning("hang watchdog: decision not published (%s)", e)
        if self.rank == 0:
            rec = hang_record(
                self.attempt,
                verdicts,
                decision,
                self.world_size,
                recovered=False,
                kill_t=time.time(),
            )
            if self.meter is not None:
                self.meter.event(rec)
                self.meter.flush(timeout=max(1.0, cfg.grace_s))
            publish_bytes(str(d / RECORDED), json.dumps(rec))
        elif 0 not in decision["missing_ranks"]:
            # If we exit first, torchrun may kill rank 0 before its record is on disk. A
            # silent rank 0 writes none: the next attempt's rank 0 recovers it.
            until = time.monotonic() + 2 * cfg.grace_s  # rank 0's verdict wait, then its flush
            while not (d / RECORDED).exists() and time.monotonic() < until:
                time.sleep(min(0.05, cfg.poll_s))
        print(
            f"[watchdog] rank {self.rank}: hang of rank(s) {decision['stuck_ranks']} "
            f"({decision['cause']})",
            file=sys.stderr,
            flush=True,
        )
        return decision
