"""Fault injection for tests and demos: crashes, crashes during a save, random failures, stalls,
hangs.

Driven by the ``[faults]`` config section or by the environment variable
``STEADYTRAIN_FAULTS`` (same keys, ``;``-separated, e.g.
``STEADYTRAIN_FAULTS="kill_at_steps=5,12;kill_in_save_at_steps=8;mtbf_s=30"``), which wins
over the file so a test can inject faults into an unchanged config.

A crash is ``SIGKILL`` to this very process: no ``finally`` block, no atexit handler and no
flush runs, exactly like a machine that loses power. Each scheduled fault fires once per run:
before dying, the process publishes a marker file under ``RUN_DIR/faults/`` so the attempt that
torchrun restarts does not crash again at the same step (real failures do not repeat either).

A hang (``hang_at_step=N;hang_rank=R``) blocks rank R forever in step N right before the
step's loss all-reduce, so the other ranks wait in that collective: in Python
(``hang_mode=sleep``, the hang watchdog sees the frame) or stopped by ``SIGSTOP``
(``hang_mode=sigstop``, the process answers nothing). Only the hang watchdog
(monitor/watchdog.py) ends it; it fires once per run like the crashes.

Random failures follow a Poisson process in wall-clock time: failure times are drawn once from
``seed`` and counted from the first start of the run (kept in ``RUN_DIR/faults/t0``), so a
slower run (e.g. with blocking checkpoints) meets more of them, as it would on a cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import time
from typing import Any

from steadytrain.train.config import FaultConfig, _build_section

__all__ = ["FaultInjector", "faults_from_env", "ENV_VAR"]

ENV_VAR = "STEADYTRAIN_FAULTS"


def faults_from_env(base: FaultConfig, env: dict[str, str] | None = None) -> FaultConfig:
    """``base`` with the keys given in ``STEADYTRAIN_FAULTS`` replaced."""
    spec = (env if env is not None else os.environ).get(ENV_VAR, "").strip()
    if not spec:
        return base
    values: dict[str, Any] = dataclasses.asdict(base)
    for item in spec.replace("\n", ";").split(";"):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            from steadytrain.errors import ConfigError

            raise ConfigError(f"{ENV_VAR}: {item!r} is not key=value (e.g. kill_at_steps=5,12)")
        values[key.strip()] = value.strip()
    return _build_section(FaultConfig, values, "faults")


class FaultInjector:
    """Decides, at fixed points of the loop, whether this process should fail now."""

    def __init__(self, cfg: FaultConfig, run_dir: str, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.dir = os.path.join(run_dir, "faults")
        self.targeted = cfg.kill_rank in (-1, rank)
        self._failure_times: list[float] = []
        self.started = time.time()  # this attempt
        os.makedirs(self.dir, exist_ok=True)
        if cfg.mtbf_s > 0 and self.targeted:
            self._failure_times = self._draw_failure_times()

    # -- bookkeeping ---------------------------------------------------------------------
    def _marker(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.fired")

    def fired(self, name: str) -> bool:
        return os.path.exists(self._marker(name))

    def _record(self, name: str, detail: dict[str, Any]) -> bool:
        """Publish the marker; False if another process already fired this fault."""
        try:
            fd = os.open(self._marker(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"rank": self.rank, "pid": os.getpid(), "t": time.time(), **detail}, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _die(self, name: str, message: str, **detail: Any) -> None:
        if not self._record(name, detail):
            return
        print(f"[fault] rank {self.rank}: {message} (SIGKILL)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered asynchronously; never run past this point

    def _draw_failure_times(self) -> list[float]:
        t0_path = os.path.join(self.dir, "t0")
        try:
            fd = os.open(t0_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(repr(time.time()))
        except FileExistsError:
            pass
        for _ in range(100):  # the creator may not have written it yet
            with open(t0_path) as f:
                text = f.read().strip()
            if text:
                break
            time.sleep(0.01)
        t0 = float(text)
        rng = random.Random(self.cfg.seed)
        times, t = [], t0
        for _ in range(10_000):
            t += rng.expovariate(1.0 / self.cfg.mtbf_s)
            times.append(t)
        return times

    # -- hooks called by the training loop -----------------------------------------------
    def before_data(self, step: int) -> float:
        """Stall the data read of ``step`` (1-based) if configured; returns seconds slept."""
        if step in self.cfg.slow_read_at_steps and self.cfg.slow_read_s > 0:
            if self._record(f"slow_read-{step}-rank{self.rank}", {"step": step}):
                print(
                    f"[fault] rank {self.rank}: data read of step {step} stalls "
                    f"{self.cfg.slow_read_s:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(self.cfg.slow_read_s)
                return self.cfg.slow_read_s
        return 0.0

    def mid_step(self, step: int) -> None:
        """Called after backward, before the optimizer step: the worst moment to die."""
        if step == self.cfg.hang_at_step and self.rank == self.cfg.hang_rank:
            self._hang(step)
        if not self.targeted:
            return
        if step in self.cfg.kill_at_steps:
            self._die(f"kill-{step}", f"crash in the middle of step {step}", step=step)
        self._maybe_random_failure(step)

    def after_save_started(self, step: int) -> None:
        """Called right after a checkpoint save of ``step`` began (async: still writing)."""
        if self.targeted and step in self.cfg.kill_in_save_at_steps:
            self._die(f"kill_in_save-{step}", f"crash while checkpoint {step} is saved", step=step)

    def _hang(self, step: int) -> None:
        """Block this rank forever, once per run; the other ranks wait in the next collective."""
        if not self._record(f"hang-{step}", {"step": step, "mode": self.cfg.hang_mode}):
            return
        print(
            f"[fault] rank {self.rank}: hangs in step {step} before its collective "
            f"({self.cfg.hang_mode})",
            file=sys.stderr,
            flush=True,
        )
        if self.cfg.hang_mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops: the watchdog's too
        while True:  # after SIGCONT too: a hang does not end by itself
            time.sleep(3600)

    def _maybe_random_failure(self, step: int) -> None:
        now = time.time()
        while self._failure_times and self._failure_times[0] <= now:
            t = self._failure_times.pop(0)
            # A failure time before this attempt started fell into an earlier attempt or the
            # restart itself: it has been paid for already.
            if t > self.started:
                self._die(
                    f"mtbf-{t:.6f}", f"random failure (MTBF {self.cfg.mtbf_s:g}s), step {step}"
                )
