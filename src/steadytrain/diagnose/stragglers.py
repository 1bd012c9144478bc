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
import statistics
from typing import Any

from steadytrain.diagnose.incident import Incident
from steadytrain.diagnose.inputs import RunRecords
from steadytrain.diagnose.straggler_cause import cause
from steadytrain.diagnose.straggler_incidents import incidents
from steadytrain.diagnose.straggler_parts import (
    Episode,
    excess_s,
    fold_windows,
    jitter,
    runs_of,
    signal_value,
)
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.records import finite_tree
from steadytrain.monitor.windows import (
    Window,
    compute_factor,
    compute_wait_s,
    fold,
    healthy_ref,
    host_evidence,
)

__all__ = ["alert_config", "detect", "windows_of", "MIN_WINDOWS", "NOISE_K", "WINDOW_STEPS"]

# The rules are split by what they decide: this module finds each rank's slow episodes;
# straggler_cause names their causes, straggler_incidents makes them incidents, and
# straggler_parts holds what those share (and ``shared``, the whole-job rule, too).

WINDOW_STEPS = 5  # steps per judged window
MIN_WINDOWS = 3  # slow windows an episode needs (persistence: 15 steps)
# ... and a slow forward pass that only its lead sets apart (every host as loaded, or no
# host signals, on CPU: ``windows.compute_factor``'s unspecific factor in every window).
# At load 10-15 on this 2-core machine the scheduler held one healthy rank of a clean
# 24-step run at 3.2-4.1x for all four of its judged windows (20 steps), the longest any
# run measured here could show; so half as long again (30 steps).
MIN_WINDOWS_UNSPECIFIC = 6
# ... and the same where the ranks' forward passes jump more than this share of their level
# from window to window (``_noisy``): at a device's steady level they move 1-3 %.
NOISY_REL = 0.10
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
    episodes: list[Episode] = []
    for signal in ("data", "compute"):
        episodes += _signal_episodes(signal, wins, cfg, device, total_step_s)
    for ep in episodes:
        cause(ep, wins, cfg, device)
    episodes = [e for e in episodes if e.kind]  # a slow loader the scheduler explains
    for ep in episodes:  # the episode's first and last slow step, not its windows' edges
        ep.evidence["_steps"] = _edges(ep, chunks, grid, width, wins)
    spans = [(c[0] * width + 1, (c[-1] + 1) * width) for c in chunks]  # each window's steps
    _throttled_compute(episodes, wins, cfg, device)
    return incidents(rec, episodes, wins, spans)


def _throttled_compute(episodes: list[Episode], wins: list[dict[int, Window]],
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
            ref = healthy_ref(signal_value(x, "compute") for x in row.values())
            v = None if w is None else signal_value(w, "compute")
            if (r, i) in covered or w is None or v is None or not ref or len(row) < 2:
                continue
            factor, _ = _compute_rule(w, row, r, ref, device, cfg)
            if v >= factor * ref and v - ref >= cfg.straggler_min_s:
                ep.compute_waits[i] = compute_wait_s(w, ref)


def _edges(ep: Episode, chunks: list[list[int]], grid: dict[int, dict[int, dict[str, float]]],
           width: int, wins: list[dict[int, Window]]) -> tuple[int, int]:  # fmt: skip
    """(first, last) step of the episode: within its edge windows, the first and last step
    bin where the rank stood above the window's healthy level by half its excess."""
    key = "data_wait_s" if ep.signal == "data" else "forward_s"
    g = grid[ep.rank]

    def slow(i: int) -> list[int]:
        ref = healthy_ref(signal_value(w, ep.signal) for w in wins[i].values()) or 0.0
        mine = signal_value(wins[i][ep.rank], ep.signal) or 0.0
        cut = ref + 0.5 * (mine - ref)
        return [b for b in chunks[i] if b in g and g[b].get("n")
                and g[b].get(key, 0.0) / g[b]["n"] >= cut]  # fmt: skip

    first_bins, last_bins = slow(ep.windows[0]), slow(ep.windows[-1])
    first_bin = first_bins[0] if first_bins else chunks[ep.windows[0]][0]
    if ep.windows[0] == 0:  # slow from the start: the warm-up steps it was slow in count
        w0 = wins[0]
        ref = healthy_ref(signal_value(w, ep.signal) for w in w0.values()) or 0.0
        cut = ref + 0.5 * ((signal_value(w0[ep.rank], ep.signal) or 0.0) - ref)
        b = first_bin - 1
        while b >= 0 and b in g and g[b].get("n") and g[b].get(key, 0.0) / g[b]["n"] >= cut:
            first_bin, b = b, b - 1
    first = first_bin * width + 1
    last = ((last_bins[-1] if last_bins else chunks[ep.windows[-1]][-1]) + 1) * width
    return first, last


def _signal_episodes(
    signal: str, wins: list[dict[int, Window]], cfg: AlertConfig, device: str | None,
    total_step_s: float,
) -> list[Episode]:  # fmt: skip
    refs = [healthy_ref(signal_value(w, signal) for w in row.values()) if len(row) > 1 else None
            for row in wins]  # fmt: skip
    noise = jitter(refs)
    ranks = sorted({r for row in wins for r in row})
    noisy = signal == "compute" and _noisy(wins, ranks, signal)
    out = []
    for r in ranks:
        # For compute, also the rank's own noise against the healthy level: a slow device
        # moves its forward time once and keeps it there, while a healthy rank on a noisy
        # host jumps from window to window (the lower quarter of a few noisy ranks sits
        # below each of them by chance: a clean run with 60 % jitter gave 1.54x). Not
        # for data: a slow link's waits are noisy by nature (0.67, 0.56, 0.37, 0.15 s/step
        # in one 2-of-3 matrix run) and would hide behind their own jitter.
        own = 0.0 if signal != "compute" else jitter([
            None if (w := row.get(r)) is None or (v := signal_value(w, signal)) is None or ref is None
            else v - ref
            for row, ref in zip(wins, refs, strict=True)
        ])  # fmt: skip
        flags, strong = [], []
        for row, ref in zip(wins, refs, strict=True):
            w = row.get(r)
            v = None if w is None else signal_value(w, signal)
            if v is None or ref is None or w is None:
                flags.append(False)
                strong.append(False)
                continue
            step = statistics.median(x.per(x.step_s) or 0.0 for x in row.values())
            share = cfg.straggler_share * step
            factor, use_own = cfg.straggler_compute_factor, False
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
            # On a run whose ranks' forward passes jump from window to window, a lead that
            # nothing on the host explains needs the unspecific rule's persistence too.
            strong.append(factor > cfg.straggler_compute_factor or (noisy and use_own))
        if signal == "compute":
            _throttled_episodes(r, wins, refs, cfg, flags, strong)
        for idx in runs_of(flags):
            n_slow = sum(flags[i] for i in idx)
            if n_slow < MIN_WINDOWS:
                continue  # not persistent: one slow window is a hiccup, not a fault
            if all(strong[i] for i in idx if flags[i]) and n_slow < MIN_WINDOWS_UNSPECIFIC:
                continue  # nothing but its lead sets it apart: the scheduler's, this long
            span = range(idx[0], idx[-1] + 1)
            lost = sum(excess_s(wins[i], r, refs[i], signal) for i in span)
            if lost < MIN_LOST_SHARE * total_step_s:
                continue
            ep = Episode(r, signal, list(span))
            ep.evidence = {"lost_s": lost, "noise_s_per_step": noise}
            out.append(ep)
    return out


def _noisy(wins: list[dict[int, Window]], ranks: list[int], signal: str) -> bool:
    """Whether the ranks' own values jump from window to window by more than ``NOISY_REL``
    of their level (the median rank's ``jitter`` over its median): a shared or busy host's
    scheduler, not a device. There the lowest of a few ranks sits below the others by
    chance, and one healthy rank led it 1.57x for three windows of four in a clean run of
    the suite's property test (50 % per-step jitter on every rank alike, a quiet host:
    tests/unit/test_diagnose_stragglers.py); a slow device moves its level once and keeps
    it, which a fault found this way still shows after ``MIN_WINDOWS_UNSPECIFIC``."""
    rel = []
    for r in ranks:
        series = [signal_value(row[r], signal) if r in row else None for row in wins]
        vals = [v for v in series if v is not None]
        level = statistics.median(vals) if vals else 0.0
        if level > 0:
            rel.append(jitter(series) / level)
    return bool(rel) and statistics.median(rel) > NOISY_REL


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
        v = None if w is None else signal_value(w, "compute")
        if v is None or ref is None or w is None:
            soft.append(False)
            continue
        step = statistics.median(x.per(x.step_s) or 0.0 for x in row.values())
        soft.append(v >= base * ref and v - ref >= cfg.straggler_min_s
                    and compute_wait_s(w, ref) >= cfg.straggler_share * step)  # fmt: skip
    for idx in runs_of(soft):
        if sum(soft[i] for i in idx) < MIN_WINDOWS:
            continue
        me = fold_windows([wins[i][r] for i in idx if r in wins[i]])
        others = sorted({o for i in idx for o in wins[i] if o != r})
        peers = [fold_windows([wins[i][o] for i in idx if o in wins[i]]) for o in others]
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
    mine = signal_value(w, "compute") or 0.0
    cut = ref + 0.5 * (mine - ref)
    peers = [x for o, x in row.items() if o != r and (signal_value(x, "compute") or 0.0) <= cut]
    peers = peers or [x for o, x in row.items() if o != r]
    evidence, _ = host_evidence(w, peers)
    factor = compute_factor(evidence, device, cfg)
    return factor, factor <= cfg.straggler_compute_factor and evidence != "throttled"


def _device(view: Any) -> str | None:
    for s in view.ranks.values():
        for a in reversed(s.attempts):
            if a.get("device") in ("cpu", "cuda"):
                return a["device"]
    return None
