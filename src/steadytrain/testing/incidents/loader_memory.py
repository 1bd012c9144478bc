"""Incident replay ``loader-memory``: a growing-index loader fills /dev/shm on one node.

The incident this project remembers (DESIGN.md): a data loader built a sample index that
grew with the number of steps, in shared memory, until /dev/shm blew up. Two nodes, one rank
each, train the tiny GPT on a local real-text dataset for ``STEPS`` steps, twice:

- **without the fix**: node-1's rank uses ``NaiveIndexLoader`` (steadytrain.testing.
  naive_loader: every step appends a few MiB of index to a file in /dev/shm and scans it
  whole), node-0's keeps TokenLoader. Nothing is faked: the meter samples RSS and /dev/shm
  (monitor/memory.py) into each rank's file, and the report (steadytrain.diagnose) must find
  one ``loader-memory`` incident on node-1 (its rank), lasting to the end, and nothing else.
- **with the fix**: TokenLoader on both nodes (its state is a handful of integers, invariant
  2): no incident at all, /dev/shm flat.

/dev/shm is one file system for the whole machine, so node-0's rank sees node-1's growth
too (its ``shm_bytes`` rise); what sets node-1's rank apart is that the index pages are
also mapped in its own RSS, and that its data wait grows. ``shm_growth_bytes`` per run is
the /dev/shm growth node-1's rank recorded from its first to its last step.

node-0's rank waits for node-1's inside the all-reduce; rank 0's ledger books that as
compute, and the report charges it back as ``straggler_wait``, so the cost shows in the
goodput pair, in ``train_s`` (the seconds the same ``STEPS`` steps took) and in the incident.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from steadytrain.testing import naive_loader
from steadytrain.testing.incidents.common import (
    IncidentJob,
    Log,
    incident_rows,
    run_summary,
    small_shards,
)
from steadytrain.testing.incidents.common import reports as reports_of
from steadytrain.testing.incidents.expect import expectation, judge, node_ranks
from steadytrain.testing.nodes import Node, NodeHarness

__all__ = ["STEPS", "expected", "leftover_index_files", "naive_job", "replay"]

STEPS = 24  # the live check needs 10 steps, the report a window of 10+ after warm-up (5)
NAIVE_NODE = "node-1"
TAIL_STEPS = 6  # the growth lasts to the end: so must the incident, within this many steps
MiB = 1 << 20


def naive_job(
    h: NodeHarness,
    nodes: Sequence[Node],
    run_dir: str,
    settings: Sequence[str],
    *,
    naive_nodes: Sequence[str],
    **kwargs: Any,
) -> IncidentJob:
    """An ``IncidentJob`` whose agents run ``python -m steadytrain.testing.naive_loader``
    (the real training loop; the naive loader on ``naive_nodes``, TokenLoader elsewhere)."""
    env = {**(kwargs.pop("env", None) or {}), naive_loader.NODES_ENV: ",".join(naive_nodes)}
    return IncidentJob(
        h, nodes, run_dir, settings, env=env, module="steadytrain.testing.naive_loader", **kwargs
    )


def expected(run_dir: str, nodes: Sequence[str], steps: int) -> dict[str, Any]:
    """One ``loader-memory`` incident on ``nodes`` (their ranks): the index grows from the
    first step, so it starts in the first half of the run and lasts to its end."""
    return expectation(
        "loader-memory", nodes, node_ranks(run_dir), (1, steps // 2), (steps - TAIL_STEPS, steps)
    )


def leftover_index_files(run_dir: str) -> list[str]:
    """Index files a killed naive loader left in /dev/shm (none after a clean run)."""
    tag = naive_loader.index_tag(run_dir)
    return glob.glob(os.path.join("/dev/shm", f"{naive_loader.PREFIX}{tag}-*"))


def _node_row(rep: dict[str, Any], node: str) -> dict[str, Any]:
    rows = [r for r in rep.get("ranks", []) if r.get("node") == node]
    if not rows:
        raise RuntimeError(
            f"{rep.get('run_dir')}: the report has no rank on {node}; see its ranks/ files"
        )
    return rows[0]


def _growth_bytes(row: dict[str, Any], key: str) -> int | None:
    v = row.get(key)
    return None if v is None else int(v * MiB)


def replay(workdir: str, *, log: Log) -> dict[str, Any]:
    """Both runs on a fresh 2-node harness under ``workdir``; see the module docstring."""
    t0 = time.monotonic()
    dataset = small_shards(os.path.join(workdir, "ds"), tokens=60_000, shard_tokens=4096)
    settings = [
        f"data.dataset={dataset}",
        f"train.max_steps={STEPS}",
        "checkpoint.every_steps=1000",  # the final save only: this run is about memory
    ]
    runs: dict[str, Any] = {}
    dirs = {name: os.path.join(workdir, name) for name in ("without_fix", "with_fix")}
    os.makedirs(workdir, exist_ok=True)
    h = NodeHarness(os.path.join(workdir, "harness"), nodes=2, cache_size="32M", log=log)
    with h:
        for name, run_dir in dirs.items():
            log(f"[loader-memory] {name}: {STEPS} steps on 2 nodes ({run_dir})")
            try:
                if name == "without_fix":
                    job = naive_job(h, h.nodes, run_dir, settings, naive_nodes=[NAIVE_NODE])
                else:
                    job = IncidentJob(h, h.nodes, run_dir, settings)
                job.wait(timeout=600)
            finally:
                for path in leftover_index_files(run_dir):
                    log(f"[loader-memory] removing {path} (its process was killed)")
                    os.unlink(path)
        mode, reason = h.mode, h.reason
    reports = reports_of(dirs)
    for name, run_dir in dirs.items():
        rep = reports[name]
        row = _node_row(rep, NAIVE_NODE)
        runs[name] = {
            **run_summary(run_dir, rep),
            "node": NAIVE_NODE,
            "rank": row["rank"],
            "loader": "NaiveIndexLoader" if name == "without_fix" else "TokenLoader",
            "shm_growth_bytes": _growth_bytes(row, "shm_growth_mib"),
            "rss_growth_bytes": _growth_bytes(row, "rss_growth_mib"),
            "data_wait_share": row.get("data_wait_share"),
            # the same STEPS steps: the straggler's cost, in seconds
            "train_s": row.get("step_s"),
        }
        log(
            f"[loader-memory] {name}: {NAIVE_NODE} (rank {row['rank']}) /dev/shm "
            f"{row.get('shm_growth_mib') or 0:+.0f} MiB, RSS "
            f"{row.get('rss_growth_mib') or 0:+.0f} MiB, data wait "
            f"{100 * (row.get('data_wait_share') or 0):.0f} % of its step time"
        )
    leftovers = h.leftovers()
    # The object store (unused here: the dataset is local) is not worth keeping.
    shutil.rmtree(os.path.join(workdir, "harness", "seaweed"), ignore_errors=True)
    incidents = []
    for name, rep in reports.items():
        incidents += incident_rows(rep, name)
    want = {
        "without_fix": [expected(runs["without_fix"]["run_dir"], [NAIVE_NODE], STEPS)],
        "with_fix": [],
    }
    return {
        "incident": "loader-memory",
        "mode": mode,
        "mode_reason": reason,
        "incidents": incidents,
        "expected": want,
        "checks": judge(want, incidents),
        "goodput": {k: reports[k].get("goodput") for k in ("without_fix", "with_fix")},
        "runs": runs,
        "shm_growth_bytes": {k: runs[k]["shm_growth_bytes"] for k in runs},
        "train_s": {k: runs[k]["train_s"] for k in runs},
        "steps": STEPS,
        "naive_node": NAIVE_NODE,
        "seconds": time.monotonic() - t0,
        "leftovers": leftovers,
    }
