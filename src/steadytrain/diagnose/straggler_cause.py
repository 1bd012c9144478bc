"""A straggler episode's cause, judged over the whole episode: ``data_cause`` for a slow
``next()`` (reads, cache misses, memory growth, its own cgroup's quota), ``compute_kind``
for a slow forward pass; a slow loader with no signature of its own must also lead
(``_loader_lead``)."""

from __future__ import annotations

import statistics
from typing import Any

from steadytrain.diagnose.straggler_parts import Episode, fold_windows, signal_value
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.windows import (
    Window,
    compute_factor,
    compute_kind,
    data_cause,
    healthy_ref,
    host_evidence,
)

__all__ = ["cause", "MIN_WINDOWS_LOADER"]

# A slow loader with no signature of its own on a host no busier (``_loader_lead``):
# its data wait's lead in clean runs lasted at most three windows (1.6-2.6x), injected data
# faults led 7-34x in every window.
MIN_WINDOWS_LOADER = 4


def cause(ep: Episode, wins: list[dict[int, Window]], cfg: AlertConfig, device: str | None
           ) -> None:  # fmt: skip
    """Sets ``ep.kind`` and its evidence, judged over the whole episode (an empty kind:
    no incident, ``_loader_lead``)."""
    r, signal = ep.rank, ep.signal
    parts = [(i, wins[i]) for i in ep.windows]
    me = fold_windows([row[r] for _, row in parts if r in row])
    # healthy peers: ranks whose own value stayed near the healthy level in the episode
    others = sorted({o for _, row in parts for o in row if o != r})
    refs = [healthy_ref(signal_value(w, signal) for w in row.values()) for _, row in parts]
    peers = []
    for o in others:
        excess = [
            (signal_value(row[o], signal) or 0.0) - (ref or 0.0)
            for (_, row), ref in zip(parts, refs, strict=True)
            if o in row
        ]
        if excess and statistics.median(excess) < 0.5 * _median_excess(parts, refs, r, signal):
            peers.append(fold_windows([row[o] for _, row in parts if o in row]))
    ref = statistics.median([x for x in refs if x is not None] or [0.0])
    mine = signal_value(me, signal) or 0.0
    ev: dict[str, Any] = {**ep.evidence}
    if signal == "data":
        # memory grows from the start: measure it from the first judged window
        since = [wins[i][r] for i in range(0, ep.windows[-1] + 1) if r in wins[i]]
        grown = fold_windows(since)
        peer_grown = [
            fold_windows([wins[i][o] for i in range(0, ep.windows[-1] + 1) if o in wins[i]])
            for o in others
        ]
        me.mem_first, me.mem_last = grown.mem_first, grown.mem_last
        healthy = peers or [fold_windows([row[o] for _, row in parts if o in row])
                            for o in others]  # fmt: skip
        for p, g in zip(healthy, peer_grown, strict=False):
            p.mem_first, p.mem_last = g.mem_first, g.mem_last
        base = fold_windows([wins[i][r] for i in range(0, ep.windows[0]) if r in wins[i]])
        kind, cause_ev = data_cause(me, healthy, base if base.n else None, cfg)
        ev.update(data_wait_s_per_step=mine, healthy_data_wait_s_per_step=ref, **cause_ev)
        # A rank its own cgroup throttled (more than the healthy ranks') waits in next()
        # for that reason: its reads and its loader run on the CPU the quota withholds.
        # Cache misses and memory growth are signatures a quota cannot make; slow reads
        # and a slow loader are not.
        evidence, host = host_evidence(me, healthy)
        if evidence == "throttled" and kind in ("storage", "dataloader"):
            if not cause_ev["cache_misses_up"]:
                kind = "host-contention"
                ev.update(host={**host, "evidence": evidence})
        if kind == "dataloader" and not _loader_lead(ep, wins, evidence, device, cfg):
            return
    else:
        ratio = mine / ref if ref > 0 else float("inf")
        healthy = peers or [fold_windows([row[o] for _, row in parts if o in row])
                            for o in others]  # fmt: skip
        kind, host = compute_kind(me, healthy)
        ev.update(forward_s_per_step=mine, healthy_forward_s_per_step=ref, forward_ratio=ratio)
        ev.update(host=host or None)
    ev["step_s_per_step"] = me.per(me.step_s)
    ep.kind, ep.evidence = kind, ev


def _loader_lead(ep: Episode, wins: list[dict[int, Window]], evidence: str,
                 device: str | None, cfg: AlertConfig) -> bool:  # fmt: skip
    """Whether a ``dataloader`` episode (a slow ``next()`` with reads, cache misses and
    memory flat: no signature of its own) is a fault and not the scheduler's: where its
    host is as loaded as the healthy ranks' (or recorded nothing), on CPU, its data wait
    must lead theirs by ``compute_factor`` (3x) in ``MIN_WINDOWS_LOADER`` windows, as a
    slow forward pass must in ``MIN_WINDOWS_UNSPECIFIC``. A loader is Python on the CPU: in the benchmark's clean runs on
    this loaded machine one rank's data wait led the others' 1.6-2.6x for three windows
    (its reads of the object store starved of CPU), while every injected data fault led
    7-34x in every window."""
    need = compute_factor(evidence, device, cfg)
    if need <= cfg.straggler_compute_factor:
        return True  # its host names a cause, or could explain nothing: the floors decide
    leads = 0
    for i in ep.windows:
        row = wins[i]
        ref = healthy_ref(signal_value(w, "data") for w in row.values())
        mine = signal_value(row[ep.rank], "data") if ep.rank in row else None
        leads += bool(mine is not None and ref and mine >= need * ref)
    return leads >= MIN_WINDOWS_LOADER


def _median_excess(parts: list[tuple[int, dict[int, Window]]], refs: list[float | None],
                   r: int, signal: str) -> float:  # fmt: skip
    vals = [
        (signal_value(row[r], signal) or 0.0) - (ref or 0.0)
        for (_, row), ref in zip(parts, refs, strict=True)
        if r in row
    ]
    return statistics.median(vals) if vals else 0.0
