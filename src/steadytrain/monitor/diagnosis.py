"""Diagnosis: which per-step costs moved together with a slowdown, and what to look at next.

Used by the alert engine (alerts.py). ``diagnose`` compares a window of recent steps with the
attempt's baseline, per step: data wait, checkpoint blocking, compute and the rest. The
largest increase names the cause; a data-wait cause is refined with the storage signals
(read latency p99, cache misses) of the steps that waited longest, and with memory growth.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steadytrain.monitor.alerts import AlertConfig

__all__ = [
    "NEXT_STEPS",
    "NEXT_STEPS_CPU",
    "Stats",
    "advice",
    "band_text",
    "device_of",
    "diagnose",
]

NEXT_STEPS = {
    "storage": (
        "Reads got slower or the cache stopped hitting: check the cache hit ratio and "
        "read p99 in the ledger, whether shards were evicted from a tiered file system or "
        "node-local cache (re-stage them with `steadytrain stage`), and the object store's "
        "latency and throttling."
    ),
    "data-loader memory": (
        "Loader memory grows with the step count: look for an index, cache or list that "
        "grows per step (sample indices built for all iterations, unbounded prefetch, "
        "leaked batches), watch /dev/shm and worker RSS, and compare with the loader's "
        "state size; memory must not grow with steps."
    ),
    "data loading": (
        "The loader cannot keep up while storage and memory look flat: raise prefetch "
        "depth or workers, move tokenization/decoding offline, and profile time inside "
        "next() on one rank."
    ),
    "checkpointing": (
        "Saves block the loop: switch to async_mode='thread' or 'process', lengthen the "
        "interval (`steadytrain plan` gives the best one), check checkpoint storage "
        "bandwidth and failed saves."
    ),
    "compute/hardware": (
        "The step itself got slower with data wait flat: check GPU clocks and thermal "
        "throttling (nvidia-smi -q -d PERFORMANCE), ECC/Xid errors in dmesg, a straggler "
        "rank (compare per-rank step times), NCCL bandwidth, and other processes on the node."
    ),
    "host contention": (
        "The host's CPUs were oversubscribed (run queue above the core count, steal or "
        "throttling): look for other processes on the node (top), more threads than cores "
        "(ranks per node x OMP_NUM_THREADS) and a throttled virtual machine. Not a hardware "
        "fault of the rank."
    ),
    "other": (
        "Time between steps grew outside data, compute and checkpointing: look at logging, "
        "evaluation, garbage collection and host-side synchronisation."
    ),
}

# Advice that differs on a CPU run (gloo, no accelerator): GPU clocks, nvidia-smi, Xid errors
# and NCCL mean nothing there, and the usual cause is the machine's other work.
NEXT_STEPS_CPU = {
    "compute/hardware": (
        "The step itself got slower with data wait flat, on CPU: look for other processes "
        "competing for the cores (top; load average against the core count), more threads "
        "than cores (ranks per node x train.threads or OMP_NUM_THREADS), CPU frequency "
        "scaling or a throttled virtual machine, and a straggler rank (compare per-rank step "
        "times). Small CPU runs are noisy: a few percent of jitter is not an incident."
    ),
}


def advice(diagnosis: str, device: str | None = None) -> str:
    """What to look at next for ``diagnosis`` on ``device`` ("cpu", "cuda"; ``None`` when
    the ledger does not say: the accelerator advice, the common case)."""
    if device == "cpu" and diagnosis in NEXT_STEPS_CPU:
        return NEXT_STEPS_CPU[diagnosis]
    return NEXT_STEPS.get(diagnosis, "")


def band_text(band: tuple[float, float], learned: bool) -> str:
    """The band as the report draws it: "this attempt's learned band (at least 6,899)" when
    learned from the attempt's own baseline, "the expected band (5,000-9,000)" when configured."""
    lo, hi = band
    where = f"at least {lo:,.0f}" if hi == float("inf") else f"{lo:,.0f}-{hi:,.0f}"
    return f"this attempt's learned band ({where})" if learned else f"the expected band ({where})"


def device_of(job_start: dict[str, Any]) -> str | None:
    """The attempt's device: the record's ``device`` (what the loop resolved), else an
    explicit ``train.device`` in its config; ``None`` when unknown ("auto", a library run)."""
    device = job_start.get("device")
    if device is None:
        train = (job_start.get("config") or {}).get("train") or {}
        device = train.get("device") if isinstance(train, dict) else None
    return device if device in ("cpu", "cuda") else None


def _mean(steps: list[dict[str, Any]], key: str) -> float | None:
    vals = [s[key] for s in steps if s.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


class Stats:
    """Aggregates of a list of step records (a window or the baseline)."""

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        self.n = len(steps)
        self.wall = sum(s["step_s"] for s in steps) or 1e-12
        self.tokens = sum(s["tokens"] for s in steps)
        self.data = sum(s["data_wait_s"] for s in steps)
        self.ckpt = sum(s["checkpoint_block_s"] for s in steps)
        self.compute = sum(s["compute_s"] for s in steps)
        self.compute_med = statistics.median(s["compute_s"] for s in steps)
        # Means, not medians: when an alert fires, only the newest steps of the window are
        # slow, and the diagnosis must see what those steps did.
        self.read_p99 = _mean(steps, "read_p99_s")
        self.misses = _mean(steps, "cache_misses")
        # Storage signals on the steps that waited longest for data: did reads get slower
        # or miss the cache on exactly the steps that stalled?
        slow = sorted(steps, key=lambda s: s["data_wait_s"])[-max(1, self.n // 4) :]
        self.slow_read_p99 = _mean(slow, "read_p99_s")
        self.slow_misses = _mean(slow, "cache_misses")

    def per_step(self, total: float) -> float:
        return total / max(1, self.n)


def diagnose(
    recent: Stats,
    base: Stats | None,
    memory_growing: bool,
    cfg: AlertConfig,
    force_data: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The likely cause of a slowdown, from which per-step costs moved versus the baseline."""
    ev: dict[str, Any] = {
        "data_wait_share": recent.data / recent.wall,
        "checkpoint_block_share": recent.ckpt / recent.wall,
        "compute_s_median": recent.compute_med,
        "read_p99_s": recent.read_p99,
        "cache_misses_per_step": recent.misses,
        "memory_growing": memory_growing,
    }
    if base is not None:
        d = {
            "data": recent.per_step(recent.data) - base.per_step(base.data),
            "ckpt": recent.per_step(recent.ckpt) - base.per_step(base.ckpt),
            "compute": recent.per_step(recent.compute) - base.per_step(base.compute),
        }
        d["other"] = recent.per_step(recent.wall) - base.per_step(base.wall) - sum(d.values())
        ev.update({f"delta_{k}_s_per_step": v for k, v in d.items()})
        ev["compute_ratio"] = recent.per_step(recent.compute) / max(
            base.per_step(base.compute), 1e-12
        )
        cause = max(d, key=lambda k: d[k])
    elif ev["data_wait_share"] >= cfg.data_wait_share:
        cause = "data"
    elif ev["checkpoint_block_share"] >= cfg.checkpoint_block_share:
        cause = "ckpt"
    else:
        cause = "compute"
    if force_data:
        cause = "data"
    if cause == "data":
        storage = False
        if recent.slow_read_p99 is not None and base is not None and base.read_p99 is not None:
            ev["read_p99_ratio"] = recent.slow_read_p99 / max(base.read_p99, 1e-9)
            storage |= ev["read_p99_ratio"] >= cfg.read_p99_factor
        if recent.slow_misses is not None and base is not None and base.misses is not None:
            ev["slow_step_cache_misses"] = recent.slow_misses
            storage |= recent.slow_misses >= max(2 * base.misses, base.misses + 0.5)
        if storage:
            return "storage", ev
        return ("data-loader memory" if memory_growing else "data loading"), ev
    return {"ckpt": "checkpointing", "compute": "compute/hardware", "other": "other"}[cause], ev
