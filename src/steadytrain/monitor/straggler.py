"""Straggler diagnosis: which rank (or node) made the others wait, and doing what.

DDP's all-reduce equalises every rank's step *wall* time: a rank that is slow to fetch its
batch makes every other rank wait inside the collective, so wall time alone cannot name it
(and rank 0's own ledger then blames "compute"). What differs between ranks is the time each
spends on its *own* work before the sync point: its data wait (time inside ``next()``) and
its forward pass (``forward_s``, before DDP's collectives). So, over a window of steps
aligned by step index (never by the ranks' wall clocks), each rank is compared with the
median of the *other* ranks:

* **data straggler**: its data wait per step exceeds the others' by at least
  ``straggler_share`` of the median step time (and ``straggler_min_s``); the cause is
  ``storage`` on its node when its read p99 or cache misses are up (against the other ranks
  or its own baseline), ``data-loader memory`` on that rank when its RSS + /dev/shm grew by
  ``straggler_memory_bytes`` more than the others', ``data loading`` on that rank otherwise.
  When every rank of one node straggles (and only those), one alert names the node.
* **compute straggler**: its forward time is ``straggler_compute_factor`` x the others'
  (and at least ``straggler_min_s`` more per step).
* **shared slowdown**: no rank stands out, but every rank's step time is up by
  ``shared_slowdown`` over its own baseline: the cause is one they share (storage every
  node reads, data loading, compute on every rank, or the collectives / host work between).

The same ``classify`` runs live (``straggler_live.StragglerCheck``: rank 0's background
thread reads every rank's new records through ``RankTail``) and after the run (``analyze``: the report, over
``RanksView.aligned()``), so the report names a straggler even when the live check was off.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.diagnosis import advice
from steadytrain.monitor.ranks import RanksView

__all__ = ["Window", "fold", "classify", "analyze", "to_alert", "finding_key", "device_of_ranks"]

MiB = 1 << 20


@dataclass
class Window:
    """One rank's aggregates over a window of steps (per step means via ``per``)."""

    n: int = 0
    step_s: float = 0.0
    data_wait_s: float = 0.0
    forward_s: float | None = None
    cache_misses: float | None = None
    read_p99_s: float | None = None  # the window's maximum
    mem_first: float | None = None  # RSS + /dev/shm at the window's first sample
    mem_last: float | None = None
    first_step: int | None = None
    last_step: int | None = None

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
    n = 0
    step_s = wait = 0.0
    fwd = miss = p99 = mem_first = mem_last = None
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
        rss, shm = p.get("rss_bytes"), p.get("shm_bytes")
        if rss is not None or shm is not None:
            mem_last = float((rss or 0.0) + (shm or 0.0))
            mem_first = mem_last if mem_first is None else mem_first
    return Window(
        n=int(n),
        step_s=float(step_s),
        data_wait_s=float(wait),
        forward_s=fwd,
        cache_misses=miss,
        read_p99_s=p99,
        mem_first=mem_first,
        mem_last=mem_last,
        first_step=first,
        last_step=last,
    )


def _others_medians(values: dict[int, float | None]) -> dict[int, float | None]:
    """For every rank, the median of the *other* ranks' values, in O(N log N): the sorted
    values once, then each rank's own value left out by index arithmetic (a check over
    thousands of ranks must not cost N^2 in rank 0's background thread)."""
    ranked = sorted(v for v in values.values() if v is not None)
    out: dict[int, float | None] = {}
    for r, v in values.items():
        skip = bisect.bisect_left(ranked, v) if v is not None else len(ranked)
        n = len(ranked) - (v is not None)
        if n <= 0:
            out[r] = None
            continue

        def at(k: int, skip: int = skip) -> float:
            return ranked[k if k < skip else k + 1]

        out[r] = at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
    return out


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _where(ranks: list[int], nodes: dict[int, str | None]) -> str:
    names = ", ".join(str(r) for r in ranks)
    node = nodes.get(ranks[0])
    return f"rank{'s' if len(ranks) > 1 else ''} {names}" + (f" (node {node})" if node else "")


def _data_cause(
    r: int, recent: dict[int, Window], base: dict[int, Window] | None, cfg: AlertConfig
) -> tuple[str, dict[str, Any]]:
    """(diagnosis, evidence) for a rank that waits for data longer than the others."""
    me, others = recent[r], [w for o, w in recent.items() if o != r]
    ev: dict[str, Any] = {}
    p99, o99 = me.read_p99_s, _median(w.read_p99_s for w in others)
    b99 = base[r].read_p99_s if base and r in base else None
    ev.update(read_p99_s=p99, others_read_p99_s=o99, baseline_read_p99_s=b99)
    slow_reads = False
    for ref in (o99, b99):
        if p99 is not None and ref is not None:
            slow_reads |= p99 >= max(cfg.read_p99_factor * ref, cfg.read_p99_min_s)
    miss, omiss = me.per(me.cache_misses), _median(w.per(w.cache_misses) for w in others)
    ev.update(cache_misses_per_step=miss, others_cache_misses_per_step=omiss)
    missing = miss is not None and omiss is not None and miss >= max(2 * omiss, omiss + 0.5)
    grow, ogrow = me.mem_growth, _median(w.mem_growth for w in others)
    ev.update(memory_growth_bytes=grow, others_memory_growth_bytes=ogrow)
    memory = grow is not None and grow - (ogrow or 0.0) >= cfg.straggler_memory_bytes
    # Cache misses are storage's own signature. Slow reads alone are not, when this rank's
    # loader memory grew far past the others': a loader whose index grows slows its own
    # lookups (and a loaded host slows every read), so the memory is the better explanation.
    if missing or (slow_reads and not memory):
        return "storage", ev
    if memory:
        return "data-loader memory", ev
    return "data loading", ev


def classify(
    recent: dict[int, Window],
    base: dict[int, Window] | None,
    nodes: dict[int, str | None],
    cfg: AlertConfig,
) -> list[dict[str, Any]]:
    """Findings for one window: ``{kind, ranks, node, diagnosis, cause, message,
    evidence}`` per straggler (or node), or one shared slowdown; ``[]`` when healthy."""
    recent = {r: w for r, w in recent.items() if w.n > 0}
    if len(recent) < 2:
        return []  # one rank has nobody to wait for: the alert engine covers it
    per = {
        r: (w.per(w.step_s), w.per(w.data_wait_s), w.per(w.forward_s)) for r, w in recent.items()
    }
    med_step = _median(p[0] for p in per.values()) or 0.0
    floor = max(cfg.straggler_min_s, cfg.straggler_share * med_step)
    data: dict[int, dict[str, Any]] = {}
    compute: dict[int, dict[str, Any]] = {}
    o_steps, o_waits, o_fwds = (
        _others_medians({r: p[i] for r, p in per.items()}) for i in range(3)
    )
    for r, (step, wait, fwd) in per.items():
        o_step, o_wait, o_fwd = o_steps[r], o_waits[r], o_fwds[r]
        common = {
            "steps": [recent[r].first_step, recent[r].last_step],
            "step_s_per_step": step,
            "others_step_s_per_step": o_step,
            "data_wait_s_per_step": wait,
            "others_data_wait_s_per_step": o_wait,
            "forward_s_per_step": fwd,
            "others_forward_s_per_step": o_fwd,
        }
        if base and r in base and base[r].n:
            common["baseline_data_wait_s_per_step"] = base[r].per(base[r].data_wait_s)
        if wait is not None and o_wait is not None and wait - o_wait >= floor:
            data[r] = {**common, "excess_s_per_step": wait - o_wait, "threshold_s": floor}
        elif fwd is not None and o_fwd and fwd >= cfg.straggler_compute_factor * o_fwd:
            if fwd - o_fwd >= cfg.straggler_min_s:
                compute[r] = {**common, "forward_ratio": fwd / o_fwd}
    out = []
    # The ranks of one node that all straggle (and nothing else does) make one node finding.
    by_node: dict[str | None, list[int]] = {}
    for r in recent:
        by_node.setdefault(nodes.get(r), []).append(r)
    groups: list[list[int]] = []
    flagged_nodes = {nodes.get(r) for r in data}
    for node in flagged_nodes:
        ranks = sorted(by_node.get(node, []))
        if node is not None and len(ranks) > 1 and all(r in data for r in ranks):
            if len(flagged_nodes) == 1:
                groups.append(ranks)
                continue
        groups += [[r] for r in sorted(r for r in data if nodes.get(r) == node)]
    for ranks in sorted(groups):
        r = max(ranks, key=lambda x: data[x]["excess_s_per_step"])  # the worst speaks
        diagnosis, ev = _data_cause(r, recent, base, cfg)
        node = nodes.get(r)
        cause = {
            "storage": f"storage on node {node}" if node else f"storage of rank {r}",
            "data-loader memory": f"loader memory on rank {r}",
            "data loading": f"data loading on rank {r}",
        }[diagnosis]
        if len(ranks) > 1 and diagnosis != "storage":
            cause = f"{diagnosis} on node {node} (ranks {', '.join(map(str, ranks))})"
        d = data[r]
        msg = (
            f"straggler: {_where(ranks, nodes)} waits {d['data_wait_s_per_step']:.3f} s/step "
            f"for data vs {d['others_data_wait_s_per_step']:.3f} s on the other ranks, whose "
            f"steps ({d['others_step_s_per_step']:.3f} s) wait for it; likely cause: {cause}"
        )
        out.append(_finding("straggler", ranks, node, diagnosis, cause, msg, {**d, **ev}))
    for r, d in sorted(compute.items()):
        node = nodes.get(r)
        msg = (
            f"straggler: {_where([r], nodes)} runs its forward pass "
            f"{d['forward_ratio']:.1f}x slower than the other ranks "
            f"({d['forward_s_per_step']:.3f} vs {d['others_forward_s_per_step']:.3f} s/step); "
            f"likely cause: compute on rank {r}"
        )
        out.append(
            _finding("straggler", [r], node, "compute/hardware", f"compute on rank {r}", msg, d)
        )
    if not out and base:
        out += _shared(recent, base, nodes, cfg)
    return out


def _shared(
    recent: dict[int, Window],
    base: dict[int, Window],
    nodes: dict[int, str | None],
    cfg: AlertConfig,
) -> list[dict[str, Any]]:
    """Every rank slower than its own baseline by ``shared_slowdown``, none standing out."""
    rises, d_step, d_wait, d_fwd = [], [], [], []
    for r, w in recent.items():
        b = base.get(r)
        if b is None or not b.n or not b.step_s:
            return []
        bs, s = b.per(b.step_s) or 0.0, w.per(w.step_s) or 0.0
        rises.append(s / bs - 1 if bs > 0 else 0.0)
        d_step.append(s - bs)
        d_wait.append((w.per(w.data_wait_s) or 0.0) - (b.per(b.data_wait_s) or 0.0))
        if w.forward_s is not None and b.forward_s is not None:
            d_fwd.append((w.per(w.forward_s) or 0.0) - (b.per(b.forward_s) or 0.0))
    if statistics.median(rises) < cfg.shared_slowdown or min(rises) < cfg.shared_slowdown / 2:
        return []
    step, wait = statistics.median(d_step), statistics.median(d_wait)
    fwd = statistics.median(d_fwd) if d_fwd else 0.0
    p99 = _median(w.read_p99_s for w in recent.values())
    b99 = _median(b.read_p99_s for b in base.values())
    miss = _median(w.per(w.cache_misses) for w in recent.values())
    bmiss = _median(b.per(b.cache_misses) for b in base.values())
    grow = _median(w.mem_growth for w in recent.values())
    ev = {
        "step_s_rise_median": statistics.median(rises),
        "step_s_rise_min": min(rises),
        "delta_step_s_per_step": step,
        "delta_data_wait_s_per_step": wait,
        "delta_forward_s_per_step": fwd,
        "read_p99_s": p99,
        "baseline_read_p99_s": b99,
        "cache_misses_per_step": miss,
        "baseline_cache_misses_per_step": bmiss,
        "memory_growth_bytes": grow,
        "ranks": len(recent),
    }
    every = "every node" if len({nodes.get(r) for r in recent}) > 1 else "the node"
    if wait >= 0.5 * step:
        storage = p99 is not None and b99 is not None
        storage = storage and p99 >= max(cfg.read_p99_factor * b99, cfg.read_p99_min_s)
        if miss is not None and bmiss is not None:
            storage |= miss >= max(2 * bmiss, bmiss + 0.5)
        if storage:
            diagnosis, cause = "storage", f"storage shared by {every}"
        elif grow is not None and grow >= cfg.straggler_memory_bytes:
            diagnosis, cause = "data-loader memory", "loader memory on every rank"
        else:
            diagnosis, cause = "data loading", "data loading on every rank"
    elif fwd >= 0.25 * step:  # forward is about a third of a step's compute
        diagnosis, cause = "compute/hardware", "compute on every rank"
    else:
        diagnosis, cause = "other", f"collectives or host work shared by {every}"
    msg = (
        f"shared slowdown: every rank's step time is up {statistics.median(rises):.0%} "
        f"(at least {min(rises):.0%}) over its baseline and no rank stands out; "
        f"likely cause: {cause}"
    )
    return [_finding("shared_slowdown", sorted(recent), None, diagnosis, cause, msg, ev)]


def _finding(
    kind: str,
    ranks: list[int],
    node: str | None,
    diagnosis: str,
    cause: str,
    message: str,
    evidence: dict[str, Any],
) -> dict[str, Any]:
    return {
        "kind": kind,
        "rank": ranks[0] if len(ranks) == 1 else None,
        "ranks": ranks,
        "node": node,
        "diagnosis": diagnosis,
        "cause": cause,
        "message": message,
        "evidence": evidence,
    }


def to_alert(f: dict[str, Any], step: int | None, t: float | None, device: str | None) -> dict:
    """A finding as a ledger ``alert`` record; ``next`` fits the device."""
    who = (
        ""
        if f["kind"] == "shared_slowdown"
        else f"Start with {_where(f['ranks'], {f['ranks'][0]: f['node']})}: "
    )
    return {
        "type": "alert",
        "t": t,
        "step": step,
        **{k: f[k] for k in ("kind", "message", "diagnosis", "rank", "ranks", "node", "cause")},
        "next": who + advice(f["diagnosis"], device),
        "evidence": f["evidence"],
    }


def finding_key(f: dict[str, Any]) -> tuple[Any, ...]:
    return (f["kind"], tuple(f["ranks"]), f["diagnosis"])


def analyze(
    view: RanksView, cfg: AlertConfig | None = None, device: str | None = None
) -> list[dict[str, Any]]:
    """The report's post-hoc check: ``classify`` over consecutive windows of the aligned
    step bins; one alert per incident (its first window's evidence, ``last_step`` where
    it ended)."""
    cfg = cfg or AlertConfig()
    width, grid = view.aligned()
    bins = sorted({b for g in grid.values() for b in g if (b + 1) * width > cfg.warmup})
    if not bins:
        return []
    per_window = max(1, math.ceil(cfg.straggler_window / width))
    need = max(3, cfg.straggler_window // 2)
    base_bins = bins[: max(1, math.ceil(cfg.baseline / width))]
    base = {r: fold((b * width + 1, g[b]) for b in base_bins if b in g) for r, g in grid.items()}
    out: list[dict[str, Any]] = []
    open_: dict[tuple[Any, ...], dict[str, Any]] = {}
    for i in range(0, len(bins), per_window):
        chunk = bins[i : i + per_window]
        recent = {r: fold((b * width + 1, g[b]) for b in chunk if b in g) for r, g in grid.items()}
        if max((w.n for w in recent.values()), default=0) < need:
            continue
        last = (chunk[-1] + 1) * width
        seen = set()
        # where each rank ran this window (a restart may have moved it to another node)
        nodes = {r: s.node_at(chunk[0] * width + 1) for r, s in view.ranks.items()}
        for f in classify(recent, base, nodes, cfg):
            k = finding_key(f)
            seen.add(k)
            if k in open_:
                open_[k]["last_step"] = last
                continue
            alert = to_alert(f, chunk[0] * width + 1, None, device_of_ranks(view))
            alert["source"], alert["last_step"] = "report", last
            open_[k] = alert
            out.append(alert)
        for k in list(open_):
            if k not in seen:
                del open_[k]
    return out


def device_of_ranks(view: RanksView) -> str | None:
    for s in view.ranks.values():
        for a in reversed(s.attempts):
            if a.get("device") in ("cpu", "cuda"):
                return a["device"]
    return None
