"""Straggler episodes as incidents: overlapping episodes of one kind are one incident naming
every node and rank, with its cost per window (``wait_s_per_step``, which the report
charges as ``straggler_compute``); a throttled rank's two incidents (slow ``next()`` and
slow forward pass) become one (``_one_hold_up``); and each incident's message."""

from __future__ import annotations

from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords
from steadytrain.diagnose.straggler_parts import (
    Episode,
    attempt_of,
    excess_s,
    signal_value,
    t_of,
)
from steadytrain.monitor.windows import Window, healthy_ref

__all__ = ["incidents"]


def incidents(rec: RunRecords, episodes: list[Episode], wins: list[dict[int, Window]],
              spans: list[tuple[int, int]]) -> list[Incident]:  # fmt: skip
    """Straggler episodes as incidents, a throttled rank's two as one."""
    return _one_hold_up(_incidents(rec, episodes, wins, spans))


def _incidents(rec: RunRecords, episodes: list[Episode], wins: list[dict[int, Window]],
               spans: list[tuple[int, int]]) -> list[Incident]:  # fmt: skip
    """Overlapping episodes of one kind as one incident (every node and rank named)."""
    groups: list[list[Episode]] = []
    # by kind and signal: a throttled rank can be slow in next() and in its forward pass at
    # once, two measures of one fault (the engine merges their incidents, costs added)
    for ep in sorted(episodes, key=lambda e: (e.kind, e.signal, e.windows[0])):
        same = groups and (groups[-1][0].kind, groups[-1][0].signal) == (ep.kind, ep.signal)
        g = groups[-1] if same else None
        if g is not None and ep.windows[0] <= max(e.windows[-1] for e in g) + 1:
            g.append(ep)
        else:
            groups.append([ep])
    out = []
    for g in groups:
        kind = g[0].kind
        first_w, last_w = min(e.windows[0] for e in g), max(e.windows[-1] for e in g)
        signal = g[0].signal
        lost = 0.0
        # compute: [first step, last step, s/step, rank] per window, for the charge
        waits: list[list[Any]] = []
        for i in range(first_w, last_w + 1):
            row = wins[i]
            ref = healthy_ref(signal_value(w, signal) for w in row.values())
            # a throttled rank's forward pass beside its slow next(): data excess, then
            # compute, one after the other (``_throttled_compute``)
            extra = {e.rank: e.compute_waits.get(i, 0.0) * row[e.rank].n
                     for e in g if e.rank in row}  # fmt: skip
            cost = {e.rank: excess_s(row, e.rank, ref, signal) + extra.get(e.rank, 0.0)
                    for e in g}  # fmt: skip
            who, here = max(cost.items(), key=lambda kv: kv[1], default=(None, 0.0))
            lost += here
            if signal == "compute" and here > 0 and who in row and row[who].n:
                waits.append([*spans[i], here / row[who].n, who])
            elif extra.get(who) and row[who].n:
                waits.append([*spans[i], extra[who] / row[who].n, who])
        first = min(e.evidence["_steps"][0] for e in g)
        last = max(e.evidence["_steps"][1] for e in g)
        ranks = sorted({e.rank for e in g})
        nodes = rec.nodes_of(ranks, first)
        worst = max(g, key=lambda e: e.evidence.get("lost_s", 0.0))
        ev = {**worst.evidence, "worst_rank": worst.rank}
        ev.pop("lost_s", None)
        ev.pop("_steps", None)
        if len(g) > 1:
            ev["per_rank"] = {str(e.rank): _brief(e.evidence) for e in g}
        if waits:  # what the report charges, straggler_compute (report/ranks.py)
            ev["wait_s_per_step"] = waits
        inc = Incident(kind=kind, nodes=nodes, ranks=ranks, first_step=first, last_step=last,
                       lost_s=lost, evidence=ev, t=t_of(rec, first),
                       attempt=attempt_of(rec, first))  # fmt: skip
        inc.message = _message(inc)
        out.append(inc)
    return out


def _one_hold_up(incidents: list[Incident]) -> list[Incident]:
    """A throttled rank slow in ``next()`` and in its forward pass over the same steps is
    one fault: its two ``host-contention`` incidents (one per signal) become one, whose
    cost is both (it reaches the all-reduce after its data wait and then its compute) and
    whose message says both."""
    out: list[Incident] = []
    for inc in incidents:
        ev = inc.evidence
        mate = next(
            (o for o in out if o.kind == inc.kind == "host-contention" and o.ranks == inc.ranks
             and ("forward_ratio" in o.evidence) != ("forward_ratio" in ev)
             and o.first_step is not None and inc.first_step is not None
             and inc.first_step <= (o.last_step or o.first_step) + 1
             and o.first_step <= (inc.last_step or inc.first_step) + 1),
            None,
        )  # fmt: skip
        if mate is None:
            out.append(inc)
            continue
        fwd, data = (mate, inc) if "forward_ratio" in mate.evidence else (inc, mate)
        keep = ("data_wait_s_per_step", "healthy_data_wait_s_per_step", "read_p99_s",
                "healthy_read_p99_s", "cache_misses_per_step")  # fmt: skip
        fwd.evidence.update({k: data.evidence[k] for k in keep if k in data.evidence})
        fwd.evidence["data_lost_s"] = data.lost_s
        if data.evidence.get("wait_s_per_step"):  # its windows outside the forward episode
            fwd.evidence["wait_s_per_step"] = sorted(
                [*(fwd.evidence.get("wait_s_per_step") or []), *data.evidence["wait_s_per_step"]]
            )
        fwd.lost_s += data.lost_s
        fwd.first_step = min(fwd.first_step or 0, data.first_step or 0)
        fwd.last_step = max(fwd.last_step or 0, data.last_step or 0)
        if data.t is not None and (fwd.t is None or data.first_step == fwd.first_step):
            fwd.t, fwd.attempt = data.t, data.attempt
        fwd.message = _message(fwd)
        out[out.index(mate)] = fwd
    return out


def _brief(ev: dict[str, Any]) -> dict[str, Any]:
    keep = ("data_wait_s_per_step", "forward_s_per_step", "read_p99_s",
            "cache_misses_per_step", "memory_growth_bytes", "forward_ratio")  # fmt: skip
    return {k: ev[k] for k in keep if k in ev} | {"steps": list(ev["_steps"])}


def _ms(v: Any) -> str:
    return "?" if v is None else f"{v * 1e3:.0f} ms"


def _message(inc: Incident) -> str:
    ev = inc.evidence
    who = f"rank{'s' if len(inc.ranks) > 1 else ''} {', '.join(map(str, inc.ranks))}"
    where = f"{who} on {', '.join(inc.nodes)}" if inc.nodes else who
    span = f"steps {inc.first_step}-{inc.last_step}"
    cost = f"cost {inc.lost_s:.1f} s of job time"
    if inc.kind in ("compute", "host-contention") and "forward_ratio" in ev:
        msg = (f"{where}: forward pass {ev['forward_ratio']:.1f}x the healthy ranks' "
               f"({ev['forward_s_per_step']:.3f} vs {ev['healthy_forward_s_per_step']:.3f} "
               f"s/step) over {span}")  # fmt: skip
        if "data_wait_s_per_step" in ev:  # slow in next() too (one host-contention)
            msg += (f", and it waited {ev['data_wait_s_per_step']:.3f} s/step for data vs "
                    f"{ev['healthy_data_wait_s_per_step']:.3f} s")  # fmt: skip
        h = ev.get("host")
        if inc.kind == "host-contention" and h:
            msg += f"; host run queue {h['run_queue']:.1f} on {h['cores']:.0f} cores"
            if (h.get("steal_share") or 0.0) >= 0.005:  # shown as at least 1 %
                msg += f", steal {h['steal_share']:.0%}"
            if h.get("throttled_share"):
                msg += f", its cgroup throttled {h['throttled_share']:.0%} of the time"
        elif h and h.get("healthy_run_queue") is not None:  # compute: the host no busier
            msg += (f"; its host no more loaded than the healthy ranks' (run queue "
                    f"{h['run_queue']:.1f} vs {h['healthy_run_queue']:.1f})")  # fmt: skip
        return f"{msg}; {cost}"
    msg = (f"{where} waited {ev['data_wait_s_per_step']:.3f} s/step for data vs "
           f"{ev['healthy_data_wait_s_per_step']:.3f} s on the healthy ranks over {span}")  # fmt: skip
    if inc.kind == "storage":
        msg += f"; read p99 {_ms(ev.get('read_p99_s'))} vs {_ms(ev.get('healthy_read_p99_s'))}"
        if ev.get("cache_misses_per_step"):
            msg += f", {ev['cache_misses_per_step']:.1f} cache misses/step"
    elif inc.kind == "host-contention" and ev.get("host"):
        h = ev["host"]
        msg += f"; its cgroup throttled it {h.get('throttled_share') or 0:.0%} of the time"
        if n := len(ev.get("wait_s_per_step") or []):  # its forward pass, windows apart
            msg += f", its forward pass slow too in {n} window{'s' if n > 1 else ''}"
    elif inc.kind == "loader-memory" and ev.get("memory_growth_bytes") is not None:
        msg += f"; loader memory grew {ev['memory_growth_bytes'] / (1 << 20):.0f} MiB"
        if ev.get("healthy_memory_growth_bytes") is not None:
            msg += f" vs {ev['healthy_memory_growth_bytes'] / (1 << 20):.0f} MiB"
    return f"{msg}; {cost}"
