"""Helpers of ``steadytrain.Run`` (run.py), kept out of its way so it reads top to bottom:
the rendezvous-store check, fatal signals as exceptions, crash reasons, configs given as
dicts, the data-wait stopwatch, the evaluation clock, and the checks of the loop's calls (the
step number, a call on a Run that is not open)."""

from __future__ import annotations

import dataclasses
import operator
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from steadytrain.checkpoint.commit import MAX_STEP
from steadytrain.checkpoint.config import CheckpointerConfig
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.meter_config import MeterConfig
from steadytrain.monitor.watchdog import WatchdogConfig
from steadytrain.printable import printable

__all__ = [
    "CLEAN_REASONS",
    "DataWait",
    "EVAL_PHASE",
    "EvalClock",
    "EvalPhase",
    "SignalGuard",
    "Terminated",
    "agent_store_warning",
    "check_step",
    "checkpointer_config",
    "not_open",
    "crash_reason",
    "meter_config",
    "say",
]

# job_end reasons the report takes for a clean end (report/ranks.py ``crashes``);
# every reason Run writes for a failure is something else.
CLEAN_REASONS = ("finished", "interpreter_exit")

FIX_AGENT_STORE = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def say(msg: str) -> None:
    """A ``[steadytrain]`` line on stderr (stdout stays the user's); a path or a node name
    in it from the records shows its control characters as escapes (printable.py)."""
    print(f"[steadytrain] {printable(msg)}", file=sys.stderr, flush=True)


def agent_store_warning(env: dict[str, str] | None = None) -> str | None:
    """The warning for a torchrun whose workers share the agent's rendezvous TCPStore while
    restarts are allowed, else None.

    With the shared store (torch >= 2.4, c10d rendezvous, pytorch/pytorch#135712) restarted
    workers read the previous attempt's addresses and hang in ``init_process_group`` (9 min
    seen with torch 2.12) with no message. Run warns rather than refuses: a refusal is a
    failed attempt, and torchrun restarts a failed attempt -- straight into that hang."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    if restarts <= 0:
        return None  # no restart can happen: the shared store is harmless
    return (
        f"warning: torchrun shares its rendezvous TCPStore with the workers and allows "
        f"{restarts} restart(s); restarted workers can hang in init_process_group for "
        f"minutes (pytorch/pytorch#135712). Before torchrun: {FIX_AGENT_STORE}"
    )


class Terminated(SystemExit):
    """A fatal signal (SIGTERM: torchrun stopping the survivors of a failed attempt, Slurm
    preemption) turned into an exception, so ``Run`` records a crash and closes in order.
    A ``SystemExit``: ``except Exception`` in user code does not swallow it, and the process
    exits with 128 + the signal number, as if killed by it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class SignalGuard:
    """Raises ``Terminated`` in the main thread on SIGTERM while installed (only when the
    handler was the default: a framework's own handler is left alone). ``hold()``: from now
    on a signal is only remembered, so the ordered close it started is not cut short."""

    SIGNALS = (signal.SIGTERM,)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self.holding = False
        self.pending: int | None = None

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.holding:
            self.pending = self.pending or signum
            return
        self.pending = signum
        raise Terminated(signum)

    def hold(self) -> None:
        self.holding = True

    @property
    def installed(self) -> bool:
        """True while this guard's SIGTERM handler is the one installed."""
        return signal.SIGTERM in self._previous

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def crash_reason(exc: BaseException | None, signum: int | None = None) -> str:
    """The ``job_end`` reason of a failed attempt: never one of ``CLEAN_REASONS``."""
    if isinstance(exc, Terminated):
        return f"signal: {exc.name}"
    if exc is None and signum is not None:
        return f"signal: {signal.Signals(signum).name}"
    if exc is None:
        return "finished"
    text = " ".join(str(exc).split())[:400]  # one line, bounded (a gloo error can be long)
    return f"error: {type(exc).__name__}: {text}" if text else f"error: {type(exc).__name__}"


def _table(cls: type, value: Any, nested: dict[str, type]) -> Any:
    """``value`` as a ``cls``: None -> defaults, a dict -> ``cls(**dict)`` (nested tables
    too), an instance as it is."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        given = dict(value)
        for key, sub in nested.items():
            if isinstance(given.get(key), dict):
                given[key] = sub(**given[key])
        return cls(**given)
    raise TypeError(f"expected a {cls.__name__} or a dict, got {type(value).__name__}")


def meter_config(value: MeterConfig | dict[str, Any] | None) -> MeterConfig:
    """``monitor=`` of Run: a ``MeterConfig``, a dict of its keys (``{"watchdog": {...}}``
    nested), or None for the defaults."""
    return _table(MeterConfig, value, {"alerts": AlertConfig, "watchdog": WatchdogConfig})


def checkpointer_config(value: CheckpointerConfig | dict[str, Any] | None) -> CheckpointerConfig:
    """``checkpoint=`` of Run as a ``CheckpointerConfig`` (None: the defaults)."""
    cfg = _table(CheckpointerConfig, value, {})
    return dataclasses.replace(cfg)  # Run's own copy


class DataWait:
    """``with run.data_wait():`` -- adds the seconds inside to the step's data wait, timed on
    ``clock`` (Run's: evaluation left out)."""

    __slots__ = ("_add", "_clock", "_t")

    def __init__(
        self, add: Callable[[float], None], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._add, self._clock, self._t = add, clock, 0.0

    def __enter__(self) -> None:
        self._t = self._clock()

    def __exit__(self, *_exc: Any) -> None:
        self._add(self._clock() - self._t)


# The declared phase whose time is the ledger's ``eval_s`` and the ``eval`` bucket.
EVAL_PHASE = "eval"


class EvalClock:
    """The seconds spent inside ``eval`` phases, and a clock that leaves them out (issue 42:
    an evaluation was booked as the next step's data wait, or as checkpoint blocking when it
    fell on a save step).

    ``read()`` gives ``(outside, inside)``: ``time.perf_counter()`` less every second spent
    in evaluation so far, and those seconds. An interval timed on ``outside`` holds no
    evaluation, whichever hooks it spans -- so the trainer callbacks, which time data waits
    and saves across the Trainer's evaluations, time them on it; ``Run.step_done`` books
    the ``inside`` seconds since the previous step as the step's ``eval_s``. Nested or
    overlapping eval phases count once. Loop thread only: a counter and a clock read."""

    __slots__ = ("_depth", "_since", "_done")

    def __init__(self) -> None:
        self._depth, self._since, self._done = 0, 0.0, 0.0

    def enter(self) -> None:
        if self._depth == 0:
            self._since = time.perf_counter()
        self._depth += 1

    def leave(self) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._done += time.perf_counter() - self._since

    def read(self) -> tuple[float, float]:
        """``(perf_counter less the evaluation so far, the evaluation so far)``, one instant."""
        now = time.perf_counter()
        inside = self._done + (now - self._since if self._depth else 0.0)
        return now - inside, inside

    def outside(self) -> float:
        return self.read()[0]


class EvalPhase:
    """``run.phase("eval")``: the watchdog's phase (its deadline, its hold on the other
    ranks) with the evaluation clock running inside it. Left once, however often exited."""

    __slots__ = ("_phase", "_clock", "_open")

    def __init__(self, phase: Any, clock: EvalClock) -> None:
        self._phase, self._clock, self._open = phase, clock, False

    def __enter__(self) -> None:
        self._phase.__enter__()
        self._clock.enter()
        self._open = True

    def __exit__(self, *exc: Any) -> None:
        if self._open:
            self._open = False
            self._clock.leave()
            self._phase.__exit__(*exc)


def check_step(value: Any, previous: int, start_step: int) -> int:
    """``value`` as the step ``Run.step_done`` records, or the error that says why not,
    naming the value, the previous step and ``start_step``; raised in the caller's thread,
    before anything is saved or recorded.

    A step is an integer (a numpy or torch integer too; a bool, a float -- ``5.0`` included,
    which the checkpoint's directory name refuses anyway -- or NaN is not), above the
    previous one (so the first step after a restore is above ``start_step``: a loop that
    counts from 1 again would commit newer weights under an older step, and the next start
    would restore the older one), and below 2**53 (``MAX_STEP``: the ledger's and COMMIT's
    readers refuse larger steps; a float no longer counts by one there)."""
    where = f"previous step {previous}, start_step {start_step} (the step restored at entry)"
    dtype = str(getattr(value, "dtype", ""))
    try:
        if isinstance(value, bool) or dtype in ("bool", "torch.bool"):
            raise TypeError
        step = operator.index(value)
    except TypeError:
        raise TypeError(
            f"Run.step_done(step={value!r}): a step is an integer, not a "
            f"{type(value).__name__} ({where}). Count steps as integers: "
            "step = run.start_step, then step += 1 before each step_done"
        ) from None
    if not step < MAX_STEP:
        raise ValueError(
            f"Run.step_done(step={step}): a step must be below 2**53 = {MAX_STEP} ({where}); "
            "pass the number of the optimizer step just finished"
        )
    if step <= previous:
        raise ValueError(
            f"Run.step_done(step={step}): a step must be above the previous one ({where}). "
            "A loop that counts from 1 again after a restore would commit newer weights "
            "under an older step, and the next start would restore the older one. Start "
            "counting at run.start_step: step = run.start_step, then step += 1 before each "
            "step_done"
        )
    return step


def not_open(call: str, state: str) -> RuntimeError:
    """The error for a call on a Run that is not open (``state``: "new" or "closed")."""
    if state == "new":
        why = "before the Run was entered"
    else:
        why = "after the Run closed (after its `with` block, or after the trainer ended)"
    return RuntimeError(
        f"Run.{call}() {why}: call it inside `with Run(...) as run:`; to record another "
        "training, open a new Run on its run directory"
    )
