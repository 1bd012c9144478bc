"""Incident replay ``storage``: one node's object-store link slows mid-run.

Two nodes (1 rank each) read an ``s3://`` dataset of many small shards (1,024 tokens: a
``global`` order keeps reaching shards it has not read yet) through their own links. At
step ``SLOW_AT`` the harness slows node-1's link (``LATENCY_S`` each way per request), as
when a tiering file system evicts that node's shards. The same job runs twice:

- **without the fix**: no schedule-aware prefetch (``data.prefetch_steps=0``), empty node
  caches: each new shard is fetched on demand inside ``next()``. node-1's rank waits on
  storage and node-0 waits for it in the all-reduce: the report must find one ``storage``
  incident on node-1 (its rank), from about ``SLOW_AT`` to the end, and nothing else.
- **with the fix**: ``steadytrain stage`` warmed each node's cache, and prefetch is on (the
  default): the same slowdown costs nothing, and the report must find no incident at all.

The replay writes no diagnosis: ``incidents`` are the reports' (``expected`` says what was
injected, ``checks`` how the reports' incidents compare: steadytrain.testing.incidents.expect).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from steadytrain.testing.incidents.common import (
    IncidentJob,
    Log,
    incident_rows,
    reports,
    run_summary,
    small_shards,
)
from steadytrain.testing.incidents.expect import expectation, judge, node_ranks
from steadytrain.testing.nodes import NodeHarness

__all__ = ["LATENCY_S", "SLOW_AT", "STEPS", "expected", "replay"]

# 30 steps of 8 x 64 tokens read ~15k of the ~150k tokens: about 15 new shards after SLOW_AT
# per node, each costing a request and its answer (2 x LATENCY_S) when read on demand.
STEPS, SLOW_AT, LATENCY_S = 30, 4, 0.1
SLOW_NODE = "node-1"
# An incident needs persistence (a few steps of evidence) before it starts; the slow link
# lasts to the end, so the incident must too.
DETECT_STEPS, TAIL_STEPS = 8, 6


def expected(run_dir: str, nodes: list[str], slow_at: int, steps: int) -> dict:
    """One ``storage`` incident on ``nodes`` (their ranks), from about ``slow_at`` on."""
    return expectation(
        "storage",
        nodes,
        node_ranks(run_dir),
        (slow_at, slow_at + DETECT_STEPS),
        (steps - TAIL_STEPS, steps),
    )


def _clear(path: str) -> None:
    """Empty a node's cache (the tmpfs mount point itself stays)."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def _run(h: NodeHarness, url: str, run_dir: str, extra: list[str], log: Log) -> None:
    """One 2-node job; node-1's link slows at step SLOW_AT (its report: ``replay``)."""
    settings = [
        f"data.dataset={url}",
        "data.cache_dir=$NODE_CACHE",
        "data.shuffle=global",
        f"train.max_steps={STEPS}",
        "checkpoint.every_steps=100",  # no saves: the run is about reads
        "monitor.straggler_every_s=0.5",
        *extra,
    ]
    node1 = next(n for n in h.nodes if n.name == SLOW_NODE)
    job = IncidentJob(h, h.nodes[:2], run_dir, settings)
    try:
        job.wait_for_step(SLOW_AT, timeout=300)
        h.slow_storage(node1, latency_s=LATENCY_S)
        job.wait(timeout=300)
    finally:
        h.slow_storage(node1)
    log(f"[storage] {os.path.basename(run_dir)}: done")


def _measured(rep: dict[str, Any]) -> dict[str, Any]:
    """What the slow link cost, seen from every rank: the steps' wall time, each node's
    data wait and read p99, and the start-up that a 30-step run's own goodput includes
    (the replay's ``goodput`` leaves the first one out; the reports charge node-0's wait
    for node-1 inside the all-reduce as ``straggler_wait``)."""
    rows = rep.get("ranks") or []
    return {
        "steps_s": max((r.get("step_s") or 0.0 for r in rows), default=None),
        "data_wait_s": {str(r.get("node")): r.get("data_wait_s") for r in rows},
        "read_p99_s": {str(r.get("node")): r.get("read_p99_s") for r in rows},
        "startup_s": (rep.get("badput_s") or {}).get("startup"),
    }


def replay(workdir: str, *, log: Log) -> dict[str, Any]:
    """Both runs on a fresh 2-node harness under ``workdir``; see the module docstring."""
    t0 = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    h = NodeHarness(os.path.join(workdir, "harness"), nodes=2, cache_size="32M", log=log)
    with h:
        url = h.put_dataset(small_shards(os.path.join(workdir, "dataset")), "small-shards")
        for n in h.nodes:
            _clear(n.cache_dir)
        log(f"[storage] without the fix: prefetch off, empty caches; {SLOW_NODE} slows at "
            f"step {SLOW_AT}")  # fmt: skip
        naive_dir = os.path.join(workdir, "without_fix")
        _run(h, url, naive_dir, ["data.prefetch_steps=0"], log)

        staged = {}
        for n in h.nodes:
            _clear(n.cache_dir)
            staged[n.name] = h.stage(n, url)
            if staged[n.name].get("verified") is not True:
                raise RuntimeError(f"stage on {n.name} did not verify: {staged[n.name]}")
        log("[storage] with the fix: each node's cache staged, prefetch on")
        fixed_dir = os.path.join(workdir, "with_fix")
        _run(h, url, fixed_dir, [], log)
    log("[storage] building the reports")
    got = reports({"without_fix": naive_dir, "with_fix": fixed_dir})
    naive, fixed = got["without_fix"], got["with_fix"]
    leftovers = h.leftovers()
    # The object store's copy of the dataset is not worth keeping next to the reports.
    shutil.rmtree(os.path.join(workdir, "harness", "seaweed"), ignore_errors=True)
    incidents = incident_rows(naive, "without_fix") + incident_rows(fixed, "with_fix")
    want = {"without_fix": [expected(naive_dir, [SLOW_NODE], SLOW_AT, STEPS)], "with_fix": []}
    return {
        "incident": "storage",
        "mode": h.mode,
        "mode_reason": h.reason,
        "incidents": incidents,
        "expected": want,
        "checks": judge(want, incidents),
        "goodput": {"without_fix": naive.get("goodput"), "with_fix": fixed.get("goodput")},
        "runs": {
            "without_fix": run_summary(naive_dir, naive),
            "with_fix": run_summary(fixed_dir, fixed),
        },
        "measured": {"without_fix": _measured(naive), "with_fix": _measured(fixed)},
        "seconds": time.monotonic() - t0,
        "steps": STEPS,
        "slow_at_step": SLOW_AT,
        "latency_s": LATENCY_S,
        "dataset": url,
        "staged": {k: {"verified": v.get("verified")} for k, v in staged.items()},
        "leftovers": leftovers,
    }
