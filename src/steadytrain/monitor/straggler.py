"""Straggler diagnosis: which rank (or node) made the others wait, and doing what.

DDP's all-reduce equalises every rank's step *wall* time: a rank that is slow to fetch its
batch makes every other rank wait inside the collective, so wall time alone cannot name it
(and rank 0's own ledger then blames "compute"). What differs between ranks is the time each
spends on its *own* work before the sync point: its data wait (time inside ``next()``) and
its forward pass (``forward_s``, before DDP's collectives). So, over a window of steps
aligned by step index (never by the ranks' wall clocks), each rank is compared with the
*healthy* ranks (``monitor.windows.healthy_ref``: the fastest quarter of the ranks, so two
slow nodes of three are both named; the median of the others would itself be slow):

* **data straggler**: its data wait per step exceeds the others' by at least
  ``straggler_share`` of the median step time (and ``straggler_min_s``); the cause is
  ``storage`` on its node when its read p99 or cache misses are up (against the other ranks
  or its own baseline), ``data-loader memory`` on that rank when its RSS + /dev/shm grew by
  ``straggler_memory_bytes`` more than the others', ``data loading`` on that rank otherwise.
  When every rank of one node straggles (and only those), one alert names the node.
* **compute straggler**: its forward time is ``straggler_compute_factor`` x the healthy
  ranks' (and at least ``straggler_min_s`` more per step), twice that factor on a CPU rank
  whose host does not set it apart (every host as loaded, or no host signals:
  ``monitor.windows.compute_factor``); ``host contention`` when its own cgroup throttled
  it or its host was more loaded than the healthy ranks' hosts, ``compute/hardware``
  otherwise (``monitor.windows.compute_kind``).
* **shared slowdown**: no rank stands out, but every rank's step time is up by
  ``shared_slowdown`` over its own baseline: the cause is one they share (storage every
  node reads, data loading, compute on every rank, or the collectives / host work between).

The window judgment and the causes are ``steadytrain.monitor.windows``'s, the code the
diagnosis engine (diagnose/stragglers.py) runs over whole episodes for the report. The same
``classify`` runs live (``straggler_live.StragglerCheck``: rank 0's background
thread reads every rank's new records through ``RankTail``); ``analyze`` runs it over the
windows of ``RanksView.aligned()`` after the run (the report's incidents are the engine's).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.diagnosis import advice
from steadytrain.monitor.ranks import RanksView
from steadytrain.monitor.windows import (
    LEGACY_DIAGNOSIS,
    Window,
    compute_factor,
    compute_kind,
    data_cause,
    fold,
    healthy_ref,
    host_evidence,
    median,
)

__all__ = ["Window", "fold", "classify", "analyze", "to_alert", "finding_key", "device_of_ranks"]

MiB = 1 << 20


def _median(values: Iterable[float | None]) -> float | None:
    return median(values)


def _where(ranks: list[int], nodes: dict[int, str | None]) -> str:
    names = ", ".join(str(r) for r in ranks)
    node = nodes.get(ranks[0])
    return f"rank{'s' if len(ranks) > 1 else ''} {names}" + (f" (node {node})" if node else "")


def _data_cause(
    r: int, recent: dict[int, Window], base: dict[int, Window] | None, cfg: AlertConfig
) -> tuple[str, dict[str, Any]]:
    """(diagnosis, evidence) for a rank that waits for data longer than the others (the
    engine's ``data_cause`` against the other ranks, in the alerts' words)."""
    others = [w for o, w in recent.items() if o != r]
    kind, ev = data_cause(recent[r], others, base.get(r) if base else None, cfg)
    # the alert's older evidence names
    ev.update(others_read_p99_s=ev["healthy_read_p99_s"])
    ev.update(others_cache_misses_per_step=ev["healthy_cache_misses_per_step"])
    ev.update(others_memory_growth_bytes=ev["healthy_memory_growth_bytes"])
    return LEGACY_DIAGNOSIS[kind], ev


def classify(
    recent: dict[int, Window],
    base: dict[int, Window] | None,
    nodes: dict[int, str | None],
    cfg: AlertConfig,
    device: str | None = None,
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
    # the healthy ranks' level of each signal, not the median of the others
    h_step, h_wait, h_fwd = (healthy_ref(p[i] for p in per.values()) for i in range(3))
    for r, (step, wait, fwd) in per.items():
        common = {
            "steps": [recent[r].first_step, recent[r].last_step],
            "step_s_per_step": step,
            "others_step_s_per_step": h_step,
            "data_wait_s_per_step": wait,
            "others_data_wait_s_per_step": h_wait,
            "healthy_data_wait_s_per_step": h_wait,
            "forward_s_per_step": fwd,
            "others_forward_s_per_step": h_fwd,
        }
        if base and r in base and base[r].n:
            common["baseline_data_wait_s_per_step"] = base[r].per(base[r].data_wait_s)
        if wait is not None and h_wait is not None and wait - h_wait >= floor:
            data[r] = {**common, "excess_s_per_step": wait - h_wait, "threshold_s": floor}
        elif fwd is not None and h_fwd and fwd - h_fwd >= cfg.straggler_min_s:
            # the factor its host's evidence asks for (monitor.windows.compute_factor):
            # the base one where the host names a cause or could explain nothing, more
            # where every host is as loaded (the scheduler's noise)
            peers = [w for o, w in recent.items() if o != r]
            evidence, _ = host_evidence(recent[r], peers)
            if fwd >= compute_factor(evidence, device, cfg) * h_fwd:
                kind, host = compute_kind(recent[r], peers)
                compute[r] = {**common, "forward_ratio": fwd / h_fwd, "host": host,
                              "contended": kind == "host-contention"}  # fmt: skip
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
        # its cause against the healthy ranks (those not waiting), when there are any
        peers = {o: w for o, w in recent.items() if o not in data} or dict(recent)
        diagnosis, ev = _data_cause(r, {**peers, r: recent[r]}, base, cfg)
        if diagnosis == "data loading":
            # no signature of its own: as for a slow forward pass, on a host no busier than
            # the others' the scheduler could explain a lead below the unspecific factor
            evidence, _ = host_evidence(recent[r], [w for o, w in peers.items() if o != r])
            need = compute_factor(evidence, device, cfg)
            h = data[r]["healthy_data_wait_s_per_step"] or 0.0
            if need > cfg.straggler_compute_factor and data[r]["data_wait_s_per_step"] < need * h:
                continue
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
        if d["contended"]:
            h = d["host"]
            diagnosis = LEGACY_DIAGNOSIS["host-contention"]
            cause = f"host CPU contention on node {node}" if node else f"host of rank {r}"
            why = f" (run queue {h['run_queue']:.1f} on {h['cores']:.0f} cores"
            if h.get("throttled_share"):  # its own cgroup's CPU quota
                why += f", its cgroup throttled {h['throttled_share']:.0%} of the time"
            why += ")"
        else:
            diagnosis, cause, why = LEGACY_DIAGNOSIS["compute"], f"compute on rank {r}", ""
        msg = (
            f"straggler: {_where([r], nodes)} runs its forward pass "
            f"{d['forward_ratio']:.1f}x slower than the healthy ranks "
            f"({d['forward_s_per_step']:.3f} vs {d['others_forward_s_per_step']:.3f} s/step); "
            f"likely cause: {cause}{why}"
        )
        out.append(_finding("straggler", [r], node, diagnosis, cause, msg, d))
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
        for f in classify(recent, base, nodes, cfg, device_of_ranks(view)):
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
