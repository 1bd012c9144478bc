"""Stragglers from the rank files: which ranks made the others wait, why, and what it cost.

Over the aligned step series of every rank (``RanksView.aligned()``: by step index, never
by the nodes' clocks), windows of ``WINDOW_STEPS`` steps are judged with the shared code of
``monitor.windows``: a rank is slow when its data wait (or forward time) exceeds the
**healthy** ranks' level (``healthy_ref``: the fastest quarter, so two slow nodes of three
are both named) by more than a floor: ``straggler_min_s`` and ``NOISE_K`` times the run's
own noise (the healthy level's window-to-window jitter: a shared 2-core host's jitter is
not an incident), at a cost of at least ``straggler_share`` of the step time. A slow
forward pass must also be ``windows.compute_factor`` x the healthy level: the base factor
where its host names a cause (its own cgroup throttled it, its host more loaded) or could
explain nothing (a quiet host, a GPU), twice that where a loaded host could (every host as
loaded, or no host signals, on CPU), where the episode also needs
``MIN_WINDOWS_UNSPECIFIC`` windows: the scheduler's noise here lasted up to four. Its
own cgroup's throttling is also judged over a run of windows at the base factor
(``_throttled_episodes``: the sampler shows a new quota about two seconds late).

A rank's slow windows form an **episode** (gaps of one window are bridged); an episode
needs ``MIN_WINDOWS`` slow windows and must cost at least ``MIN_LOST_SHARE`` of the job's
step time. Its cause is judged over the whole episode (``data_cause``: read p99 and cache
misses against the healthy ranks', memory growth since the start, and a quota of its own
cgroup; ``compute_kind`` for a slow forward pass: ``host-contention`` when its own cgroup
throttled it or its host was more loaded, else ``compute``, never nothing). Episodes of one
kind that overlap are one incident naming every node and rank, spanning them all;
``lost_s`` is the job time it cost: per window, the slowest of its ranks' cost per step
times the window's steps (every other rank waited that long inside the all-reduce): the
excess data wait, or for a slow forward pass ``windows.compute_wait_s`` (listed per window
in ``wait_s_per_step``, which the report charges as ``straggler_compute``; so are the
windows where a throttled rank slow in ``next()`` had a slow forward pass too, short of an
episode of its own: ``_throttled_compute``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.records import finite_tree
from steadytrain.monitor.windows import (
    Window,
    compute_factor,
    compute_kind,
    compute_wait_s,
    data_cause,
    fold,
    healthy_ref,
    host_evidence,
)

__all__ = ["alert_config", "detect", "windows_of", "MIN_WINDOWS", "NOISE_K", "WINDOW_STEPS"]

WINDOW_STEPS = 5  # steps per judged window
MIN_WINDOWS = 3  # slow windows an episode needs (persistence: 15 steps)
# ... and a slow forward pass that only its lead sets apart (every host as loaded, or no
# host signals, on CPU: ``windows.compute_factor``'s unspecific factor in every window).
# At load 10-15 on this 2-core machine the scheduler held one healthy rank of a clean
# 24-step run at 3.2-4.1x for all four of its judged windows (20 steps), the longest any
# run measured here could show; so half as long again (30 steps).
MIN_WINDOWS_UNSPECIFIC = 6
# ... and a slow loader with no signature of its own on a host no busier (``_loader_lead``):
# its data wait's lead in clean runs lasted at most three windows (1.6-2.6x), injected data
# faults led 7-34x in every window.
MIN_WINDOWS_LOADER = 4
NOISE_K = 3.0  # a window's excess must exceed this many times the run's own jitter
MIN_LOST_SHARE = 0.02  # an episode must cost this share of the job's step time


def alert_config(starts: list[dict[str, Any]]) -> AlertConfig:
    """The alert thresholds the newest attempt ran with (defaults when it did not say)."""
    for st in reversed(starts):
        cfg = st.get("config")
        mon = cfg.get("monitor") if isinstance(cfg, dict) else None
        given = mon.get("alerts") if isinstance(mon, dict) else None
        if isinstance(given, dict):
            names = {f.name for f in dataclasses.fields(AlertConfig)}
            try:
                out = AlertConfig(**{k: v for k, v in given.items() if k in names})
            except (TypeError, ValueError, ArithmeticError):
                break
            # Read back from the ledger: NaN or inf thresholds would break the analysis.
            if finite_tree(dataclasses.asdict(out), nonneg=True):
                return out
            break
    return AlertConfig()


@dataclass
class _Episode:
    rank: int
    signal: str  # "data" or "compute"
    windows: list[int] = field(default_factory=list)  # window indices, slow ones
    kind: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    # window index -> s/step the others waited for this rank's forward pass, beside a
    # throttled rank's slow next() (``_throttled_compute``)
    compute_waits: dict[int, float] = field(default_factory=dict)


def _jitter(series: list[float | None]) -> float:
    """Robust window-to-window noise of a series: 1.4826 x the median absolute first
    difference / sqrt(2) (a step change moves it once, noise every time)."""
    vals = [v for v in series if v is not None]
    d = [abs(b - a) for a, b in zip(vals, vals[1:], strict=False)]
    return 1.4826 * statistics.median(d) / math.sqrt(2) if d else 0.0


def _episodes(flags: list[bool]) -> list[list[int]]:
    """Runs of flagged windows, gaps of one unflagged window bridged."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i, f in enumerate(flags):
        if not f:
            continue
        if cur and i - cur[-1] > 2:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def windows_of(view: Any, cfg: AlertConfig) -> tuple[int, dict[int, dict[int, dict[str, float]]],
                                                    list[list[int]], list[dict[int, Window]]]:  # fmt: skip
    """``(width, grid, chunks, wins)``: the aligned step bins after ``warmup`` cut into
    windows of about ``WINDOW_STEPS`` steps; ``wins[w][rank]`` is that rank's window (ranks
    with steps in it only), ``chunks[w]`` its bin indices."""
    width, grid = view.aligned()
    bins = sorted({b for g in grid.values() for b in g if (b + 1) * width > cfg.warmup})
    per = max(1, round(WINDOW_STEPS / width))
    chunks = [bins[i : i + per] for i in range(0, len(bins), per)]
    wins: list[dict[int, Window]] = []
    for chunk in chunks:
        row = {}
        for r, g in grid.items():
            w = fold((b * width + 1, g[b]) for b in chunk if b in g)
            if w.n > 0:
                row[r] = w
        wins.append(row)
    return width, grid, chunks, wins


def detect(rec: RunRecords, cfg: AlertConfig | None = None) -> list[Incident]:
    """Straggler incidents (storage, dataloader, loader-memory, compute, host-contention)."""
    view = rec.view
    if len(view.ranks) < 2:
        return []  # one rank has nobody to be slower than
    cfg = cfg or alert_config(rec.starts)
    width, grid, chunks, wins = windows_of(view, cfg)
    if not wins:
        return []
    device = rec.device or _device(view)
    total_step_s = statistics.median(
        [sum(w.step_s for row in wins for rr, w in row.items() if rr == r) for r in grid] or [0.0]
    )
    episodes: list[_Episode] = []
    for signal in ("data", "compute"):
        episodes += _signal_episodes(signal, wins, cfg, device, total_step_s)
    for ep in episodes:
        _cause(ep, wins, cfg, device)
    episodes = [e for e in episodes if e.kind]  # a slow loader the scheduler explains
    for ep in episodes:  # the episode's first and last slow step, not its windows' edges
        ep.evidence["_steps"] = _edges(ep, chunks, grid, width, wins)
    spans = [(c[0] * width + 1, (c[-1] + 1) * width) for c in chunks]  # each window's steps
    _throttled_compute(episodes, wins, cfg, device)
    return _one_hold_up(_incidents(rec, episodes, wins, spans))


def _throttled_compute(episodes: list[_Episode], wins: list[dict[int, Window]],
                       cfg: AlertConfig, device: str | None) -> None:  # fmt: skip
    """For a rank its own cgroup throttled and slow in ``next()`` for an episode
    (``host-contention``, data), the windows of that episode where its forward pass stood
    above the healthy ranks' too (at the factor and floor a throttled rank's forward pass
    is judged by) and no episode of its forward pass covers: what the others waited for it
    there (``windows.compute_wait_s``) is part of this incident's cost. A quota withholds
    CPU in bursts (a tenth of a core: 5 ms one step, 90-180 ms the next, in next() and in
    the forward pass alike), so in the matrix's CPU-quota run the forward pass led 10.9x
    and 5.8x for two windows only while the data wait made the episode: without this,
    only the data excess was charged (1.5 s of a job whose steps went from 0.05 s to
    0.2-0.4 s)."""
    covered = {(e.rank, i) for e in episodes if e.signal == "compute" for i in
               range(e.windows[0], e.windows[-1] + 1)}  # fmt: skip
    for ep in episodes:
        if ep.signal != "data" or ep.kind != "host-contention":
            continue
        r = ep.rank
        for i in range(ep.windows[0], ep.windows[-1] + 1):
            row = wins[i]
            w = row.get(r)
            ref = healthy_ref(_value(x, "compute") for x in row.values())
            v = None if w is None else _value(w, "compute")
            if (r, i) in covered or w is None or v is None or not ref or len(row) < 2:
                continue
            factor, _ = _compute_rule(w, row, r, ref, device, cfg)
            if v >= factor * ref and v - ref >= cfg.straggler_min_s:
                ep.compute_waits[i] = compute_wait_s(w, ref)


def _edges(ep: _Episode, chunks: list[list[int]], grid: dict[int, dict[int, dict[str, float]]],
           width: int, wins: list[dict[int, Window]]) -> tuple[int, int]:  # fmt: skip
    """(first, last) step of the episode: within its edge windows, the first and last step
    bin where the rank stood above the window's healthy level by half its excess."""
    key = "data_wait_s" if ep.signal == "data" else "forward_s"
    g = grid[ep.rank]

    def slow(i: int) -> list[int]:
        ref = healthy_ref(_value(w, ep.signal) for w in wins[i].values()) or 0.0
        mine = _value(wins[i][ep.rank], ep.signal) or 0.0
        cut = ref + 0.5 * (mine - ref)
        return [b for b in chunks[i] if b in g and g[b].get("n")
                and g[b].get(key, 0.0) / g[b]["n"] >= cut]  # fmt: skip

    first_bins, last_bins = slow(ep.windows[0]), slow(ep.windows[-1])
    first_bin = first_bins[0] if first_bins else chunks[ep.windows[0]][0]
    if ep.windows[0] == 0:  # slow from the start: the warm-up steps it was slow in count
        w0 = wins[0]
        ref = healthy_ref(_value(w, ep.signal) for w in w0.values()) or 0.0
        cut = ref + 0.5 * ((_value(w0[ep.rank], ep.signal) or 0.0) - ref)
        b = first_bin - 1
        while b >= 0 and b in g and g[b].get("n") and g[b].get(key, 0.0) / g[b]["n"] >= cut:
            first_bin, b = b, b - 1
    first = first_bin * width + 1
    last = ((last_bins[-1] if last_bins else chunks[ep.windows[-1]][-1]) + 1) * width
    return first, last


def _value(w: Window, signal: str) -> float | None:
    return w.per(w.data_wait_s) if signal == "data" else w.per(w.forward_s)


def _signal_episodes(
    signal: str, wins: list[dict[int, Window]], cfg: AlertConfig, device: str | None,
    total_step_s: float,
) -> list[_Episode]:  # fmt: skip
    refs = [healthy_ref(_value(w, signal) for w in row.values()) if len(row) > 1 else None
            for row in wins]  # fmt: skip
    noise = _jitter(refs)
    ranks = sorted({r for row in wins for r in row})
    out = []
    for r in ranks:
        # For compute, also the rank's own noise against the healthy level: a slow device
        # moves its forward time once and keeps it there, while a healthy rank on a noisy
        # host jumps from window to window (the lower quarter of a few noisy ranks sits
        # below each of them by chance: a clean run with 60 % jitter gave 1.54x). Not
        # for data: a slow link's waits are noisy by nature (0.67, 0.56, 0.37, 0.15 s/step
        # in one 2-of-3 matrix run) and would hide behind their own jitter.
        own = 0.0 if signal != "compute" else _jitter([
            None if (w := row.get(r)) is None or (v := _value(w, signal)) is None or ref is None
            else v - ref
            for row, ref in zip(wins, refs, strict=True)
        ])  # fmt: skip
        flags, strong = [], []
        for row, ref in zip(wins, refs, strict=True):
            w = row.get(r)
            v = None if w is None else _value(w, signal)
            if v is None or ref is None or w is None:
                flags.append(False)
                strong.append(False)
                continue
            step = statistics.median(x.per(x.step_s) or 0.0 for x in row.values())
            share = cfg.straggler_share * step
            factor = cfg.straggler_compute_factor
            if signal == "data":
                slow = v - ref >= max(cfg.straggler_min_s, share, NOISE_K * noise)
            else:
                # A slow forward pass costs the others its whole step's slowdown, not only
                # the forward's excess (``compute_wait_s``): the share of the step is
                # judged on that; its ratio and its excess over the noise on the forward.
                factor, use_own = _compute_rule(w, row, r, ref, device, cfg)
                floor = max(cfg.straggler_min_s, NOISE_K * noise, NOISE_K * own * use_own)
                if factor <= cfg.straggler_compute_factor and not use_own:
                    floor = cfg.straggler_min_s  # its own cgroup throttled it: the cause
                slow = v >= factor * ref and v - ref >= floor
                slow &= compute_wait_s(w, ref) >= share
            flags.append(slow)
            strong.append(factor > cfg.straggler_compute_factor)
        if signal == "compute":
            _throttled_episodes(r, wins, refs, cfg, flags, strong)
        for idx in _episodes(flags):
            n_slow = sum(flags[i] for i in idx)
            if n_slow < MIN_WINDOWS:
                continue  # not persistent: one slow window is a hiccup, not a fault
            if all(strong[i] for i in idx if flags[i]) and n_slow < MIN_WINDOWS_UNSPECIFIC:
                continue  # nothing but its lead sets it apart: the scheduler's, this long
            span = range(idx[0], idx[-1] + 1)
            lost = sum(_excess(wins[i], r, refs[i], signal) for i in span)
            if lost < MIN_LOST_SHARE * total_step_s:
                continue
            ep = _Episode(r, signal, list(span))
            ep.evidence = {"lost_s": lost, "noise_s_per_step": noise}
            out.append(ep)
    return out


def _throttled_episodes(r: int, wins: list[dict[int, Window]], refs: list[float | None],
                        cfg: AlertConfig, flags: list[bool], strong: list[bool]) -> None:  # fmt: skip
    """Flags (in place) the windows of rank ``r`` whose forward pass stood above the healthy
    level at the base factor, in runs of ``MIN_WINDOWS`` such windows over which its own
    cgroup throttled it (``host_evidence`` over the run, not window by window). The host
    sampler reads the throttled count once a second and needs two reads in a cgroup for a
    share, so a rank moved into a quota shows it two seconds late: in the 24-step jobs of
    bench/straggler_noise.py (5-step windows of about a second) the first two slow windows
    read 0 % and were judged at the unspecific factor, and both throttled runs (10-16x)
    went unnamed. Over the run the kernel's count names the cause; a clean run, whose
    ranks nobody throttles, is judged as before."""
    base = cfg.straggler_compute_factor
    soft = []
    for row, ref in zip(wins, refs, strict=True):
        w = row.get(r)
        v = None if w is None else _value(w, "compute")
        if v is None or ref is None or w is None:
            soft.append(False)
            continue
        step = statistics.median(x.per(x.step_s) or 0.0 for x in row.values())
        soft.append(v >= base * ref and v - ref >= cfg.straggler_min_s
                    and compute_wait_s(w, ref) >= cfg.straggler_share * step)  # fmt: skip
    for idx in _episodes(soft):
        if sum(soft[i] for i in idx) < MIN_WINDOWS:
            continue
        me = _fold_windows([wins[i][r] for i in idx if r in wins[i]])
        others = sorted({o for i in idx for o in wins[i] if o != r})
        peers = [_fold_windows([wins[i][o] for i in idx if o in wins[i]]) for o in others]
        if host_evidence(me, peers)[0] != "throttled":
            continue
        for i in idx:
            if soft[i]:
                flags[i], strong[i] = True, False


def _compute_rule(w: Window, row: dict[int, Window], r: int, ref: float, device: str | None,
                  cfg: AlertConfig) -> tuple[float, bool]:  # fmt: skip
    """(factor, use_own) for rank ``r``'s forward pass in one window: the ratio over the
    healthy level it needs (``compute_factor`` of its host's evidence against the healthy
    ranks' hosts of the window), and whether its own jitter raises the floor. Its own
    jitter counts at the base factor -- a healthy rank on a noisy host jumps from window to
    window -- except where its own cgroup throttled it (``use_own`` False at the base
    factor): there neither jitter floor does. Bursts are what a CPU quota makes (a fifth of
    a core ran the forward pass in 5 ms one step and 185 ms the next), the throttled time
    is the kernel's own count, not a sample, and on a machine with 11-26 runnable tasks on
    2 cores the healthy level jumped 5-31 ms from window to window: 3 x that jitter hid a
    rank held to a tenth of a core (its forward pass 2.2-5.5 x theirs, throttled 44-73 %).
    A more loaded host keeps the jitter rule: its run queue is a sample once a second, and
    on one machine two ranks' samples differed 7 to 1 for a whole run of 24 steps."""
    mine = _value(w, "compute") or 0.0
    cut = ref + 0.5 * (mine - ref)
    peers = [x for o, x in row.items() if o != r and (_value(x, "compute") or 0.0) <= cut]
    peers = peers or [x for o, x in row.items() if o != r]
    evidence, _ = host_evidence(w, peers)
    factor = compute_factor(evidence, device, cfg)
    return factor, factor <= cfg.straggler_compute_factor and evidence != "throttled"


def _excess(row: dict[int, Window], r: int, ref: float | None, signal: str) -> float:
    """Seconds rank ``r`` cost the job in this window: its excess data wait per step x the
    steps; for a slow forward pass, the others' wait its ratio implies
    (``windows.compute_wait_s``) x the steps."""
    w = row.get(r)
    v = None if w is None else _value(w, signal)
    if v is None or ref is None or w is None:
        return 0.0
    if signal == "compute":
        return compute_wait_s(w, ref) * w.n
    return max(0.0, v - ref) * w.n


def _cause(ep: _Episode, wins: list[dict[int, Window]], cfg: AlertConfig, device: str | None
           ) -> None:  # fmt: skip
    """Sets ``ep.kind`` and its evidence, judged over the whole episode (an empty kind:
    no incident, ``_loader_lead``)."""
    r, signal = ep.rank, ep.signal
    parts = [(i, wins[i]) for i in ep.windows]
    me = _fold_windows([row[r] for _, row in parts if r in row])
    # healthy peers: ranks whose own value stayed near the healthy level in the episode
    others = sorted({o for _, row in parts for o in row if o != r})
    refs = [healthy_ref(_value(w, signal) for w in row.values()) for _, row in parts]
    peers = []
    for o in others:
        excess = [
            (_value(row[o], signal) or 0.0) - (ref or 0.0)
            for (_, row), ref in zip(parts, refs, strict=True)
            if o in row
        ]
        if excess and statistics.median(excess) < 0.5 * _median_excess(parts, refs, r, signal):
            peers.append(_fold_windows([row[o] for _, row in parts if o in row]))
    ref = statistics.median([x for x in refs if x is not None] or [0.0])
    mine = _value(me, signal) or 0.0
    ev: dict[str, Any] = {**ep.evidence}
    if signal == "data":
        # memory grows from the start: measure it from the first judged window
        since = [wins[i][r] for i in range(0, ep.windows[-1] + 1) if r in wins[i]]
        grown = _fold_windows(since)
        peer_grown = [
            _fold_windows([wins[i][o] for i in range(0, ep.windows[-1] + 1) if o in wins[i]])
            for o in others
        ]
        me.mem_first, me.mem_last = grown.mem_first, grown.mem_last
        healthy = peers or [_fold_windows([row[o] for _, row in parts if o in row])
                            for o in others]  # fmt: skip
        for p, g in zip(healthy, peer_grown, strict=False):
            p.mem_first, p.mem_last = g.mem_first, g.mem_last
        base = _fold_windows([wins[i][r] for i in range(0, ep.windows[0]) if r in wins[i]])
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
        healthy = peers or [_fold_windows([row[o] for _, row in parts if o in row])
                            for o in others]  # fmt: skip
        kind, host = compute_kind(me, healthy)
        ev.update(forward_s_per_step=mine, healthy_forward_s_per_step=ref, forward_ratio=ratio)
        ev.update(host=host or None)
    ev["step_s_per_step"] = me.per(me.step_s)
    ep.kind, ep.evidence = kind, ev


def _loader_lead(ep: _Episode, wins: list[dict[int, Window]], evidence: str,
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
        ref = healthy_ref(_value(w, "data") for w in row.values())
        mine = _value(row[ep.rank], "data") if ep.rank in row else None
        leads += bool(mine is not None and ref and mine >= need * ref)
    return leads >= MIN_WINDOWS_LOADER


def _median_excess(parts: list[tuple[int, dict[int, Window]]], refs: list[float | None],
                   r: int, signal: str) -> float:  # fmt: skip
    vals = [
        (_value(row[r], signal) or 0.0) - (ref or 0.0)
        for (_, row), ref in zip(parts, refs, strict=True)
        if r in row
    ]
    return statistics.median(vals) if vals else 0.0


def _fold_windows(ws: list[Window]) -> Window:
    """Windows of one rank as one (sums add, p99: the median of the windows' maxima, so
    one outlier read does not speak for an episode)."""
    out = Window()
    p99s = [w.read_p99_s for w in ws if w.read_p99_s is not None]
    for w in ws:
        out.n += w.n
        out.step_s += w.step_s
        out.data_wait_s += w.data_wait_s
        if w.forward_s is not None:
            out.forward_s = (out.forward_s or 0.0) + w.forward_s
        if w.cache_misses is not None:
            out.cache_misses = (out.cache_misses or 0.0) + w.cache_misses
        if w.mem_first is not None and out.mem_first is None:
            out.mem_first = w.mem_first
        if w.mem_last is not None:
            out.mem_last = w.mem_last
        out.first_step = w.first_step if out.first_step is None else out.first_step
        out.last_step = w.last_step if w.last_step is not None else out.last_step
        out.host_n += w.host_n
        out.run_queue += w.run_queue
        out.cpus += w.cpus
        if w.steal is not None:
            out.steal = (out.steal or 0.0) + w.steal
        if w.throttled is not None:
            out.throttled = (out.throttled or 0.0) + w.throttled
    out.read_p99_s = statistics.median(p99s) if p99s else None
    return out


def _device(view: Any) -> str | None:
    for s in view.ranks.values():
        for a in reversed(s.attempts):
            if a.get("device") in ("cpu", "cuda"):
                return a["device"]
    return None


def _incidents(rec: RunRecords, episodes: list[_Episode], wins: list[dict[int, Window]],
               spans: list[tuple[int, int]]) -> list[Incident]:  # fmt: skip
    """Overlapping episodes of one kind as one incident (every node and rank named)."""
    groups: list[list[_Episode]] = []
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
            ref = healthy_ref(_value(w, signal) for w in row.values())
            # a throttled rank's forward pass beside its slow next(): data excess, then
            # compute, one after the other (``_throttled_compute``)
            extra = {e.rank: e.compute_waits.get(i, 0.0) * row[e.rank].n
                     for e in g if e.rank in row}  # fmt: skip
            cost = {e.rank: _excess(row, e.rank, ref, signal) + extra.get(e.rank, 0.0)
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
                       lost_s=lost, evidence=ev, t=_t_of(rec, first),
                       attempt=_attempt_of(rec, first))  # fmt: skip
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


def _t_of(rec: RunRecords, step: int) -> float | None:
    s = rec.steps
    found = None
    for i in range(len(s)):
        if s.step[i] == step:
            found = s.t[i]  # a redone step: its newest record
    return found


def _attempt_of(rec: RunRecords, step: int) -> int | None:
    s = rec.steps
    found = None
    for i in range(len(s)):
        if s.step[i] == step and s.attempt[i] >= 0:
            found = int(s.attempt[i])
    return found


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
