"""Alerts with a diagnosis: when throughput leaves its band, say which signal moved with it.

The engine watches the stream of ledger records (in the meter's background thread, never in
the training loop) and compares a rolling window of recent steps with a baseline taken
after warm-up in the same attempt. Each alert carries:

* ``kind``: what crossed a threshold (``throughput_band``, ``data_wait_share``,
  ``checkpoint_blocking``, ``memory_growth``, ``read_latency``, ``recovery_point_age``,
  ``checkpoint_failed``);
* ``diagnosis``: the likely cause, from which signals moved together with the drop --
  ``storage`` (data wait up with read latency p99 or cache misses up), ``data-loader
  memory`` (data wait up, or memory growing, while process RSS / shared memory grows with
  the step count), ``data loading`` (data wait up, storage and memory flat),
  ``checkpointing`` (blocking saves), ``compute/hardware`` (the step's own compute time up
  with data wait flat), ``other`` (time between steps grew: logging, eval, GC);
* ``next``: what to look at next; ``evidence``: the numbers behind it.

Window alerts fire once their condition has held for ``sustain`` consecutive steps, once per
incident; they re-arm when the condition clears.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from steadytrain.monitor.diagnosis import Stats, advice, band_text, device_of, diagnose
from steadytrain.printable import printable
from steadytrain.settings import check

__all__ = ["AlertConfig", "AlertEngine", "warn_alert"]

MiB = 1 << 20


def warn_alert(alert: dict[str, Any], log: logging.Logger) -> None:
    """The warning line a live alert prints as it is raised. Its message may quote a node
    name from another rank's records: control characters are shown, never obeyed."""
    log.warning("steadytrain alert %s: %s", printable(alert["kind"]), printable(alert["message"]))


@dataclass(kw_only=True)
class AlertConfig:
    """Thresholds (the ``[monitor.alerts]`` table of a training config). Windows count
    steps; shares are fractions of step wall time."""

    window: int = 20  # recent steps compared with the baseline
    warmup: int = 5  # steps ignored at the start of every attempt (compile, cache fill)
    baseline: int = 20  # steps after warm-up that define "normal" for this attempt
    band_tolerance: float = 0.2  # learned band: alert below (1 - tol) x baseline tokens/s
    data_wait_share: float = 0.2
    checkpoint_block_share: float = 0.2
    memory_window: int = 50  # memory samples fitted for growth
    memory_growth_bytes: int = 256 * MiB  # fitted growth across the window to alert
    memory_min_r2: float = 0.8
    read_p99_factor: float = 3.0
    read_p99_min_s: float = 0.005
    max_recovery_age_s: float | None = 3600.0  # None or 0: no recovery_point_age alert
    # Also alert when the newest commit is older than this many checkpoint intervals (the
    # interval the checkpoint records carry: every_steps, or interval_s); 0: off. Two
    # intervals means one save was missed entirely: a dead writer, not a slow one.
    recovery_intervals: float = 2.0
    # Window alerts fire after their condition held this many consecutive steps; the
    # default (window + 1) is longer than one outlier step (a GC pause, a descheduled
    # process) can hold a window's mean down.
    sustain: int | None = None
    # Stragglers (monitor/straggler.py): ranks compared with each other over windows of
    # steps aligned by step index, on their own data wait and forward time (not wall time,
    # which DDP's all-reduce equalises).
    straggler_window: int = 20  # aligned steps per comparison
    straggler_share: float = 0.1  # excess data wait, as a share of the median step time
    straggler_min_s: float = 0.005  # ... and at least this much per step (jitter floor)
    straggler_compute_factor: float = 1.5  # forward time x the other ranks' median
    straggler_memory_bytes: int = 64 * MiB  # RSS + /dev/shm growth beyond the others'
    shared_slowdown: float = 0.25  # every rank's step time up this much: a shared cause

    def __post_init__(self) -> None:
        if self.sustain is None:
            self.sustain = self.window + 1
        for name in ("window", "baseline", "memory_window", "straggler_window"):
            check(getattr(self, name) >= 3, name, getattr(self, name), "use at least 3")
        check(self.warmup >= 0, "warmup", self.warmup, "use 0 or more steps")
        check(self.sustain >= 1, "sustain", self.sustain, "use 1 or more steps")
        check(
            0 < self.band_tolerance < 1,
            "band_tolerance",
            self.band_tolerance,
            "use a fraction in (0, 1)",
        )
        for name in ("data_wait_share", "checkpoint_block_share"):
            value = getattr(self, name)
            check(0 < value <= 1, name, value, "use a fraction of step time in (0, 1]")
        check(0 <= self.memory_min_r2 <= 1, "memory_min_r2", self.memory_min_r2, "use [0, 1]")
        for name in ("memory_growth_bytes", "read_p99_factor", "straggler_memory_bytes"):
            check(getattr(self, name) > 0, name, getattr(self, name), "use a positive number")
        check(self.read_p99_min_s >= 0, "read_p99_min_s", self.read_p99_min_s, "use 0 or more")
        for name in ("straggler_share", "shared_slowdown"):
            check(getattr(self, name) > 0, name, getattr(self, name), "use a fraction > 0")
        check(self.straggler_min_s >= 0, "straggler_min_s", self.straggler_min_s, "use 0 or more")
        factor = self.straggler_compute_factor
        check(factor > 1, "straggler_compute_factor", factor, "use a ratio above 1, e.g. 1.5")
        if self.max_recovery_age_s == 0:
            self.max_recovery_age_s = None  # TOML cannot say None: 0 turns it off
        age = self.max_recovery_age_s
        check(age is None or age > 0, "max_recovery_age_s", age, "use None or 0 (off), or > 0")
        check(
            self.recovery_intervals >= 0,
            "recovery_intervals",
            self.recovery_intervals,
            "use 0 (off) or a number of checkpoint intervals, e.g. 2",
        )


def _band(expected: Any) -> tuple[float, float] | None:
    """(low, high) tokens/s per GPU from ``expected_tokens_per_s``; checked here, once."""
    if expected is None:
        return None
    key = "expected_tokens_per_s"
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        # One number is a floor: at least 90 % of it (faster is never an incident).
        check(expected > 0, key, expected, "use a positive rate, or None to learn the band")
        return (0.9 * float(expected), float("inf"))
    pair = isinstance(expected, (tuple, list)) and len(expected) == 2
    check(pair, key, expected, "give one number (a floor) or (low, high)")
    lo, hi = (float(x) for x in expected)
    check(0 <= lo <= hi, key, expected, "the low bound is above the high bound: give (low, high)")
    return (lo, hi)


def _fit(points: deque[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares slope (per step), r^2, and the fraction of rising samples."""
    n = len(points)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    if sxx == 0 or syy == 0:
        return 0.0, 0.0, 0.0
    rising = sum(1 for a, b in zip(ys, ys[1:], strict=False) if b > a) / (n - 1)
    return sxy / sxx, (sxy * sxy) / (sxx * syy), rising


class AlertEngine:
    """Consumes ledger records in order; :meth:`observe` returns new alert records."""

    def __init__(
        self,
        config: AlertConfig | None = None,
        expected_tokens_per_s: Any = None,
        world_size: int = 1,
    ) -> None:
        self.cfg = config or AlertConfig()
        self.band = _band(expected_tokens_per_s)
        self.world_size = max(1, world_size)
        # "cpu" or "cuda", from each attempt's job_start: advice must fit the hardware.
        self.device: str | None = None
        self.last_ckpt_t: float | None = None
        self.last_ckpt_step: int | None = None  # restored or newest committed step
        self.ckpt_every_steps = 0  # the checkpointer's interval, from its records
        self.ckpt_interval_s: float | None = None
        self._reset(None)

    def _reset(self, t: float | None) -> None:
        c = self.cfg
        self.seen = 0  # steps in this attempt
        self.window: deque[dict[str, Any]] = deque(maxlen=c.window)
        self.base_steps: list[dict[str, Any]] = []
        self.base: Stats | None = None
        self.mem: dict[str, deque[tuple[int, float]]] = {
            "rss_bytes": deque(maxlen=c.memory_window),
            "shm_bytes": deque(maxlen=c.memory_window),
        }
        self.active: set[str] = set()
        self.streak: dict[str, int] = {}
        self.attempt_t = t
        self.learned_band: tuple[float, float] | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _memory_growth(self) -> tuple[bool, bool, dict[str, Any]]:
        """(alert, moving, evidence): ``alert`` when the fitted growth over the memory
        window reaches ``memory_growth_bytes``; ``moving`` when the last ``window`` samples
        grow at the rate that would get there (what the diagnosis of a drop looks at)."""
        c = self.cfg
        out: dict[str, Any] = {}
        alert = moving = False
        rate = c.memory_growth_bytes / c.memory_window
        for key, pts in self.mem.items():
            if len(pts) >= max(5, c.memory_window // 4):
                slope, r2, rising = _fit(pts)
                growth = slope * (pts[-1][0] - pts[0][0])
                out[key] = {"bytes_per_step": slope, "growth_bytes": growth, "r2": r2}
                # Steady growth, not one allocation jump: most samples must rise.
                if growth >= c.memory_growth_bytes and r2 >= c.memory_min_r2 and rising >= 0.5:
                    alert = True
            recent = deque(list(pts)[-c.window :])
            if len(recent) >= 5:
                slope, r2, rising = _fit(recent)
                moving |= slope >= rate and r2 >= c.memory_min_r2 and rising >= 0.5
        return alert, alert or moving, out

    def _fire(
        self, kind: str, on: bool, rec: dict[str, Any], make: Any, sustain: int = 1
    ) -> list[dict[str, Any]]:
        if not on:
            self.active.discard(kind)
            self.streak[kind] = 0
            return []
        self.streak[kind] = self.streak.get(kind, 0) + 1
        if kind in self.active or self.streak[kind] < sustain:
            return []
        self.active.add(kind)
        message, diagnosis, evidence = make()
        return [
            {
                "type": "alert",
                "t": rec.get("t"),
                "step": rec.get("step"),
                "kind": kind,
                "message": message,
                "diagnosis": diagnosis,
                "next": advice(diagnosis, self.device),
                "evidence": evidence,
            }
        ]

    # -- the stream ------------------------------------------------------------------------
    def observe(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        kind = rec.get("type")
        if kind == "job_start":
            self._reset(rec.get("t"))
            self.device = device_of(rec)
            if self.last_ckpt_t is None:
                self.last_ckpt_t = rec.get("t")
            self.last_ckpt_step = int(rec.get("restored_step") or 0)
            return []
        if kind == "checkpoint":
            self.ckpt_every_steps = int(rec.get("every_steps") or 0)
            self.ckpt_interval_s = rec.get("interval_s") or None
            if rec.get("ok", True):
                self.last_ckpt_t = rec.get("t") or self.last_ckpt_t
                if rec.get("step") is not None:
                    self.last_ckpt_step = int(rec["step"])
                return []
            # Every failed save is its own incident: no re-arming needed.
            return [
                {
                    "type": "alert",
                    "t": rec.get("t"),
                    "step": rec.get("step"),
                    "kind": "checkpoint_failed",
                    "message": f"checkpoint at step {rec.get('step')} failed: {rec.get('error')}",
                    "diagnosis": "checkpointing",
                    "next": advice("checkpointing", self.device),
                    "evidence": {"path": rec.get("path"), "error": rec.get("error")},
                }
            ]
        if kind != "step":
            return []
        return self._step(rec)

    def _step(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        c = self.cfg
        s = {
            # an evaluation between steps is not the loop's throughput (issue 42)
            "step_s": max(0.0, float(rec.get("step_s") or 0.0) - float(rec.get("eval_s") or 0)),
            "tokens": int(rec.get("tokens") or 0),
            "data_wait_s": float(rec.get("data_wait_s") or 0.0),
            "checkpoint_block_s": float(rec.get("checkpoint_block_s") or 0.0),
            "compute_s": float(rec.get("compute_s") or 0.0),
            "read_p99_s": rec.get("read_p99_s"),
            "cache_misses": rec.get("cache_misses"),
        }
        self.seen += 1
        step = int(rec.get("step", self.seen))
        if self.seen > c.warmup:
            for key, pts in self.mem.items():
                if rec.get(key) is not None:
                    pts.append((step, float(rec[key])))
            if self.base is None:
                self.base_steps.append(s)
                if len(self.base_steps) >= c.baseline:
                    self.base = Stats(self.base_steps)
                    self.base_steps = []
                    tps = self.base.tokens / self.base.wall / self.world_size
                    self.learned_band = ((1 - c.band_tolerance) * tps, float("inf"))
        self.window.append(s)
        out: list[dict[str, Any]] = []
        mem_alert, growing, mem_ev = self._memory_growth()
        out += self._fire(
            "memory_growth",
            mem_alert,
            rec,
            lambda: (
                "process memory grows with the step count: "
                + ", ".join(
                    f"{k} +{v['bytes_per_step'] / MiB:.2f} MiB/step (r2={v['r2']:.2f})"
                    for k, v in mem_ev.items()
                ),
                "data-loader memory",
                mem_ev,
            ),
        )
        band = self.band or self.learned_band
        if len(self.window) == c.window and (self.seen > c.warmup + c.window):
            recent = Stats(list(self.window))
            tps = recent.tokens / recent.wall / self.world_size
            if band is not None:
                outside = not (band[0] <= tps <= band[1])
                out += self._fire(
                    "throughput_band",
                    outside,
                    rec,
                    lambda: self._explain(
                        f"tokens/s per {'GPU' if self.device == 'cuda' else 'rank'} "
                        f"{tps:,.0f} outside {band_text(band, learned=self.band is None)} "
                        f"over the last {c.window} steps",
                        recent,
                        growing,
                        {"tokens_per_s_per_gpu": tps, "band": list(band)},
                    ),
                    sustain=c.sustain,
                )
            # A caller's data_wait_s can exceed the wall time the meter measured between its
            # step() calls (inconsistent input): a share is never above 100 %.
            share = min(1.0, recent.data / recent.wall)
            out += self._fire(
                "data_wait_share",
                share > c.data_wait_share,
                rec,
                lambda: self._explain(
                    f"data wait is {share:.0%} of step time over the last {c.window} steps "
                    f"(threshold {c.data_wait_share:.0%})",
                    recent,
                    growing,
                    {},
                    force="data",
                ),
                sustain=c.sustain,
            )
            ck = min(1.0, recent.ckpt / recent.wall)
            out += self._fire(
                "checkpoint_blocking",
                ck > c.checkpoint_block_share,
                rec,
                lambda: (
                    f"checkpoint saves block {ck:.0%} of wall time over the last {c.window} "
                    f"steps (threshold {c.checkpoint_block_share:.0%})",
                    "checkpointing",
                    {"checkpoint_block_share": ck},
                ),
                sustain=c.sustain,
            )
            if self.base is not None and self.base.read_p99 is not None:
                p99, b99 = recent.read_p99, self.base.read_p99
                jump = p99 is not None and p99 >= max(c.read_p99_factor * b99, c.read_p99_min_s)
                out += self._fire(
                    "read_latency",
                    jump,
                    rec,
                    lambda: (
                        f"read latency p99 {p99 * 1e3:.1f} ms vs {b99 * 1e3:.1f} ms baseline",
                        "storage",
                        {"read_p99_s": p99, "baseline_read_p99_s": b99},
                    ),
                    sustain=c.sustain,
                )
        out += self._recovery_age(rec, step)
        return out

    def _recovery_age(self, rec: dict[str, Any], step: int) -> list[dict[str, Any]]:
        """The newest commit is older than ``max_recovery_age_s``, or than
        ``recovery_intervals`` checkpoint intervals (in steps or in seconds)."""
        c = self.cfg
        last_t = self.last_ckpt_t
        age = float(rec.get("t") or 0.0) - last_t if last_t is not None else None
        limits: list[str] = []  # each limit the recovery point is past, for the message
        if c.max_recovery_age_s is not None and age is not None and age > c.max_recovery_age_s:
            limits.append(f"limit {c.max_recovery_age_s:,.0f} s")
        if c.recovery_intervals and self.last_ckpt_step is not None and self.ckpt_every_steps:
            steps = step - self.last_ckpt_step
            if steps > c.recovery_intervals * self.ckpt_every_steps:
                limits.append(
                    f"{steps} steps since step {self.last_ckpt_step}, more than "
                    f"{c.recovery_intervals:g} intervals of {self.ckpt_every_steps} steps"
                )
        if c.recovery_intervals and self.ckpt_interval_s and age is not None:
            if age > c.recovery_intervals * self.ckpt_interval_s:
                limits.append(
                    f"more than {c.recovery_intervals:g} intervals of {self.ckpt_interval_s:,.0f} s"
                )
        return self._fire(
            "recovery_point_age",
            bool(limits),
            rec,
            lambda: (
                f"newest committed checkpoint is {age or 0.0:,.0f} s old ({'; '.join(limits)}): "
                "a failure now loses that much work; saves are failing or not happening",
                "checkpointing",
                {
                    "recovery_point_age_s": age,
                    "steps_since_checkpoint": (
                        step - self.last_ckpt_step if self.last_ckpt_step is not None else None
                    ),
                    "every_steps": self.ckpt_every_steps or None,
                    "interval_s": self.ckpt_interval_s,
                },
            ),
        )

    def _explain(
        self,
        headline: str,
        recent: Stats,
        growing: bool,
        extra: dict[str, Any],
        force: str | None = None,
    ) -> tuple[str, str, dict[str, Any]]:
        diagnosis, ev = diagnose(recent, self.base, growing, self.cfg, force == "data")
        ev.update(extra)
        return f"{headline}; likely cause: {diagnosis}", diagnosis, ev
