"""The straggler judgment both wings share: windows of steps, the healthy reference, causes.

DDP's all-reduce equalises every rank's step *wall* time, so what tells a slow rank apart
is the time it spends on its *own* work before the sync point: its data wait (time inside
``next()``) and its forward pass. Its whole step less its data wait cannot tell: every rank
leaves the all-reduce together, so that is the same on every rank (the healthy ones wait
inside it); it measures what a slow rank cost instead (``compute_wait_s``). Over a window
of steps aligned by step index, each rank is compared with the **healthy** ranks, not with
the median of the others: when two of three nodes are slow, the median of the others is
itself slow. The healthy reference is a low quantile of the ranks' values (``healthy_ref``:
the fastest quarter), so any minority up to three quarters of the ranks can be named.

The live check (monitor/straggler_live.py, through monitor/straggler.py ``classify``) and
the engine (diagnose/stragglers.py, over whole episodes) call these same functions, so live
alerts and the report agree on who is slow and why.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from steadytrain.monitor.alerts import AlertConfig

__all__ = [
    "Window",
    "fold",
    "healthy_ref",
    "median",
    "data_cause",
    "host_state",
    "host_evidence",
    "compute_factor",
    "compute_kind",
    "compute_wait_s",
    "LEGACY_DIAGNOSIS",
]

# The live alerts' ``diagnosis`` words (the ledger's alert format predates the engine's
# vocabulary) for each incident kind.
LEGACY_DIAGNOSIS = {
    "storage": "storage",
    "dataloader": "data loading",
    "loader-memory": "data-loader memory",
    "compute": "compute/hardware",
    "host-contention": "host contention",
}
# A host is contended when more tasks are runnable than it has cores, or the hypervisor
# steals or the cgroup throttles more than this share of the time.
STEAL_SHARE = 0.05
THROTTLED_SHARE = 0.05
# A slow forward pass on a CPU rank whose host does not set it apart (every host as loaded,
# or no host signals) counts only at this many times ``straggler_compute_factor``: a loaded
# host slows whichever rank the scheduler leaves out, and that is noise, not a fault of the
# rank (``compute_factor``).
UNSPECIFIC_FACTOR = 2.0


@dataclass
class Window:
    """One rank's aggregates over a window of steps (per step means via ``per``)."""

    n: int = 0
    step_s: float = 0.0
    data_wait_s: float = 0.0
    forward_s: float | None = None
    cache_misses: float | None = None
    read_p99_s: float | None = None  # the window's maximum
    read_s: float | None = None  # the reads' own time (rank_step ``read_s``), summed
    mem_first: float | None = None  # RSS + /dev/shm at the window's first sample
    mem_last: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    # host signals (sums over the steps that carried them; ``host_n`` of them)
    host_n: int = 0
    run_queue: float = 0.0
    cpus: float = 0.0
    steal: float | None = None
    throttled: float | None = None

    def per(self, total: float | None) -> float | None:
        return None if total is None or self.n <= 0 else total / self.n

    @property
    def mem_growth(self) -> float | None:
        if self.mem_first is None or self.mem_last is None:
            return None
        return self.mem_last - self.mem_first


def fold(parts: Iterable[tuple[int, dict[str, Any]]]) -> Window:
    """A ``Window`` from ``(step, part)`` pairs in step order; a part is a ``rank_step``
    record (one step) or a step bin of ``RanksView.aligned()`` (``n`` steps, sums).
    Plain locals, not attributes: the live check folds every rank's window each time."""
    n = host_n = 0
    step_s = wait = rq = cpus = 0.0
    fwd = miss = p99 = reads = mem_first = mem_last = steal = thr = None
    first = last = None
    for step, p in parts:
        k = p.get("n", 1)
        if k <= 0:
            continue
        n += k
        first = step if first is None else first
        last = step
        step_s += p.get("step_s") or 0.0
        wait += p.get("data_wait_s") or 0.0
        if (v := p.get("forward_s")) is not None:
            fwd = (fwd or 0.0) + v
        if (v := p.get("cache_misses")) is not None:
            miss = (miss or 0.0) + v
        if (v := p.get("read_p99_s")) is not None:
            p99 = v if p99 is None or v > p99 else p99
        if (v := p.get("read_s")) is not None:
            reads = (reads or 0.0) + v
        rss, shm = p.get("rss_bytes"), p.get("shm_bytes")
        if rss is not None or shm is not None:
            mem_last = float((rss or 0.0) + (shm or 0.0))
            mem_first = mem_last if mem_first is None else mem_first
        if p.get("host_cpus") is not None:
            host_n += k
            rq += p.get("host_run_queue") or 0.0
            cpus += p["host_cpus"]
            if (v := p.get("host_steal")) is not None:
                steal = (steal or 0.0) + v
            if (v := p.get("host_throttled")) is not None:
                thr = (thr or 0.0) + v
    return Window(
        n=int(n),
        step_s=float(step_s),
        data_wait_s=float(wait),
        forward_s=fwd,
        cache_misses=miss,
        read_p99_s=p99,
        read_s=reads,
        mem_first=mem_first,
        mem_last=mem_last,
        first_step=first,
        last_step=last,
        host_n=int(host_n),
        run_queue=rq,
        cpus=cpus,
        steal=steal,
        throttled=thr,
    )


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def healthy_ref(values: Iterable[float | None]) -> float | None:
    """The healthy ranks' level: the value at the lower quarter of the ranks (the fastest
    of 2 or 3 ranks, the 2nd of 8). Robust to any slow minority up to three quarters."""
    vals = sorted(v for v in values if v is not None)
    return vals[(len(vals) - 1) // 4] if vals else None


def host_state(w: Window) -> tuple[bool | None, dict[str, Any]]:
    """(contended, evidence) of the host a rank ran on over ``w``: None when the rank
    recorded no host signals (an older rank file)."""
    if not w.host_n:
        return None, {}
    k = w.host_n
    ev: dict[str, Any] = {
        "run_queue": w.run_queue / k,
        "cores": w.cpus / k,
        "steal_share": None if w.steal is None else w.steal / k,
        "throttled_share": None if w.throttled is None else w.throttled / k,
    }
    contended = ev["run_queue"] > ev["cores"]
    contended |= (ev["steal_share"] or 0.0) >= STEAL_SHARE
    contended |= (ev["throttled_share"] or 0.0) >= THROTTLED_SHARE
    return contended, ev


# read p99 at least this many times the healthy ranks' (or the rank's own earlier) marks a
# data-waiting straggler's cause as storage (data_cause)
STRAGGLER_READ_FACTOR = 2.0
# ... when its reads' own time per step (``read_s``) exceeds the healthy ranks' by at least
# this share of its data wait's excess: slow reads that cannot account for the wait are not
# its cause. A read p99 is one read's time (over the loader's last 1,024 reads, so one slow
# read stays in it for the rest of a short run); on a loaded host one read of a rank that
# stalled elsewhere passed 2x its peer's p99 and named storage for a loader stall (CI of
# 7fc5cdc, tests/e2e/train/test_straggler.py). Reads that cause a wait take at least the
# wait (it is the part of them nothing overlapped), so half leaves room for noise.
READ_EXPLAINS_SHARE = 0.5


def data_cause(
    me: Window, peers: list[Window], base: Window | None, cfg: AlertConfig
) -> tuple[str, dict[str, Any]]:
    """(kind, evidence) for a rank that waits for data longer than the healthy ranks
    (``peers``; ``base``: the rank's own earlier window, when known). Kinds: ``storage``
    (read p99 or cache misses up against the healthy ranks or its own history),
    ``loader-memory`` (its RSS + /dev/shm grew by ``straggler_memory_bytes`` more than
    theirs), ``dataloader`` otherwise."""
    ev: dict[str, Any] = {}
    p99, h99 = me.read_p99_s, median(w.read_p99_s for w in peers)
    b99 = base.read_p99_s if base is not None else None
    ev.update(read_p99_s=p99, healthy_read_p99_s=h99, baseline_read_p99_s=b99)
    # A straggler's reads only need to be clearly slower than the healthy ranks' to be the
    # likelier cause: "dataloader" means reads as fast as everyone's and the loader still
    # behind. The throughput alert's factor (3x, for a jump over the job's own history) is
    # too strict for this comparison: a slow link on a loaded host measured 2.99x.
    factor = min(cfg.read_p99_factor, STRAGGLER_READ_FACTOR)
    slow_reads = False
    for ref in (h99, b99):
        if p99 is not None and ref is not None:
            slow_reads |= p99 >= max(factor * ref, cfg.read_p99_min_s)
    if slow_reads:
        slow_reads = _reads_explain(me, peers, ev)
    miss = me.per(me.cache_misses)
    hmiss = median(w.per(w.cache_misses) for w in peers)
    ev.update(cache_misses_per_step=miss, healthy_cache_misses_per_step=hmiss)
    missing = miss is not None and hmiss is not None and miss >= max(2 * hmiss, hmiss + 0.5)
    ev["cache_misses_up"] = missing
    grow, hgrow = me.mem_growth, median(w.mem_growth for w in peers)
    ev.update(memory_growth_bytes=grow, healthy_memory_growth_bytes=hgrow)
    memory = grow is not None and grow - (hgrow or 0.0) >= cfg.straggler_memory_bytes
    # Cache misses are storage's own signature. Slow reads alone are not, when this rank's
    # loader memory grew far past the others': a loader whose index grows slows its own
    # lookups (and a loaded host slows every read), so the memory is the better explanation.
    if missing or (slow_reads and not memory):
        return "storage", ev
    if memory:
        return "loader-memory", ev
    return "dataloader", ev


def _reads_explain(me: Window, peers: list[Window], ev: dict[str, Any]) -> bool:
    """Whether a rank's reads took long enough to account for its extra data wait
    (``READ_EXPLAINS_SHARE`` of it) beyond the healthy ranks'. True when it or they did not
    record ``read_s`` (older rank files, a loader that does not count it): the p99 decides."""
    mine, theirs = me.per(me.read_s), median(w.per(w.read_s) for w in peers)
    if mine is None or theirs is None:
        return True
    wait = (me.per(me.data_wait_s) or 0.0) - (median(w.per(w.data_wait_s) for w in peers) or 0.0)
    ev.update(read_s_per_step=mine, healthy_read_s_per_step=theirs)
    return mine - theirs >= READ_EXPLAINS_SHARE * wait


def _load(ev: dict[str, Any]) -> float:
    """How contended a host was: run queue per core, or the stolen / throttled share."""
    per_core = ev["run_queue"] / max(ev["cores"], 1.0)
    return max(
        per_core, 10 * (ev.get("steal_share") or 0.0), 10 * (ev.get("throttled_share") or 0.0)
    )


def host_evidence(me: Window, peers: list[Window]) -> tuple[str, dict[str, Any]]:
    """(evidence, host) of a rank's host against the healthy ranks' (``peers``) over the
    same steps: what its host says about a slow forward pass.

    - ``throttled``: its own cgroup throttled it (``THROTTLED_SHARE`` or more, and 1.5 x
      the healthy ranks' share): a CPU quota of its own (a Slurm job's, a container's);
    - ``loaded``: its host was contended and 1.5 x as loaded as theirs (run queue per core,
      steal), or theirs recorded nothing to compare;
    - ``quiet``: its host was not contended: nothing on it explains the slowness;
    - ``shared``: contended, but no more than their hosts (one loaded machine, or every
      node running more threads than cores): the scheduler could explain it;
    - ``unknown``: the rank recorded no host signals (an older rank file)."""
    contended, host = host_state(me)
    if contended is None:
        return "unknown", host
    theirs = [e for w in peers if (e := host_state(w)[1])]
    if theirs:
        host = {**host, "healthy_run_queue": median(e["run_queue"] for e in theirs),
                "healthy_cores": median(e["cores"] for e in theirs),
                "healthy_throttled_share": max(e.get("throttled_share") or 0.0
                                               for e in theirs)}  # fmt: skip
    thr = host.get("throttled_share") or 0.0
    if thr >= THROTTLED_SHARE and thr >= 1.5 * (host.get("healthy_throttled_share") or 0.0):
        return "throttled", host
    if not contended:
        return "quiet", host
    if not theirs or _load(host) >= 1.5 * max(_load(e) for e in theirs):
        return "loaded", host
    return "shared", host


def compute_factor(evidence: str, device: str | None, cfg: AlertConfig) -> float:
    """How many times the healthy ranks' forward time a rank's must be for a window to
    count as slow, given its host's ``evidence``: ``straggler_compute_factor`` where the
    host names a cause of the rank's own (``throttled``, ``loaded``), where nothing on the
    host could explain it (``quiet``) and on a GPU; ``UNSPECIFIC_FACTOR`` x that where a
    loaded host could (``shared``, ``unknown``, on CPU). Measured on one loaded 2-core
    machine: healthy ranks of clean runs ran their forward pass 2.1-2.5x the fastest
    rank's steadily for 20 steps and 3.6-5.8x for at most two 5-step windows; a rank held to
    a fifth or a tenth of a core by a cgroup quota ran 3.7-15x in every window."""
    if device == "cuda" or evidence in ("throttled", "loaded", "quiet"):
        return cfg.straggler_compute_factor
    return UNSPECIFIC_FACTOR * cfg.straggler_compute_factor


def compute_kind(me: Window, peers: list[Window]) -> tuple[str, dict[str, Any]]:
    """(kind, host evidence) for a rank whose forward pass stood above the healthy ranks'
    (``peers``) for an episode: ``host-contention`` when its own cgroup throttled it
    (``THROTTLED_SHARE`` or more) or its host was more loaded than theirs
    (``host_evidence``), else ``compute``. Never nothing: whether the slowness is a fault
    at all is the window rule's to say (``compute_factor``), not the host's."""
    evidence, host = host_evidence(me, peers)
    own_quota = (host.get("throttled_share") or 0.0) >= THROTTLED_SHARE
    kind = "host-contention" if own_quota or evidence in ("throttled", "loaded") else "compute"
    return kind, {**host, "evidence": evidence} if host else host


def compute_wait_s(w: Window, ref: float) -> float:
    """Seconds per step the other ranks waited for a rank whose forward pass ran at
    ``forward / ref`` x the healthy level over ``w``: its own step less its data wait (the
    slowest rank waits for nobody, so that is its own work) x ``1 - ref / forward``. A
    cause of the rank's own (a CPU quota, a slow device) slows its backward pass and update
    as it slows its forward pass, and only the forward pass is timed before the
    collectives, so its ratio stands for the whole step's; the forward excess alone would
    charge a third of what the others waited."""
    fwd = w.per(w.forward_s)
    step, wait = w.per(w.step_s), w.per(w.data_wait_s)
    if fwd is None or step is None or fwd <= 0 or fwd <= ref:
        return 0.0
    return max(0.0, step - (wait or 0.0)) * (1.0 - max(ref, 0.0) / fwd)
