"""Incident replay ``node-loss``: a node dies mid-run; the job goes on, bit for bit.

One elastic job (``--nnodes 1:2``, ``train.elastic_nnodes=1:2``, 1 rank per node) reads an
``s3://`` dataset of small shards through each node's own link into its own tmpfs cache.
At step ``KILL_AT`` the harness kills node-1 whole (agent and worker, SIGKILL by PID):

- **without the fix** (no spare): node-0's collectives fail, its agent restarts the worker
  group on MIN = 1 node once node-1's seat expires, and the job resumes from the newest
  committed checkpoint on one rank.
- **with the fix**: a spare node (``NodeHarness.add_node``) had its cache warmed by
  ``steadytrain stage`` and its agent started while the job ran; the rendezvous was full,
  so it waited (torchrun's redundancy list). When node-1's seat expires, the spare takes it
  and the job resumes on 2 nodes again. The spare reads nothing from the object store after
  ``stage``: its training process says it fetched 0 shard files, and its link carried no
  shard bytes. And the job keeps a memory-tier snapshot every step
  (``checkpoint.memory.every_steps=1``, issue 28): node-0's memory holds node-1's copy,
  the killed node's memory is emptied with it (``NodeHarness.kill``), so the spare comes
  back from its peer's memory (tier ``peer-memory``), at most one step behind the kill;
  its only durable checkpoint is the last step's (``FIX_EVERY``), long after the kill.

Each run's ``restores`` (tier, seconds, steps lost per restart) are its report's
(``steadytrain report --json``), or, from a report that has none, its ledger's ``restore``
records (``elastic.restores``). The job itself (its settings, the spare waiting in the
rendezvous, the kill) is ``elastic.py``'s, shared with tests/nodes/test_memory_tier_nodes.py.

Continuation is checked against an uninterrupted 2-node reference run of the same job:

- with the fix the world size never changes (2, then 2), so the run must be bit-exact:
  per step the same loss (``==``) and sample ids, and the same SHA-256 of the final weights
  (``RUN_DIR/final.json``). A 2-rank all-reduce adds two numbers, which commutes, so it
  does not matter which node holds which rank after the restart;
- without it the steps after the restart ran on 1 rank. The project's guarantee there
  (docs/operations.md, "Several machines") is the same samples in the same order, and
  losses close but not bit for bit (one rank sums micro-batch gradients in another order):
  sample ids must be equal at every step, losses bit-exact on the steps run on 2 ranks and
  within ``REL_TOL`` after.

The replay writes no diagnosis: ``incidents`` are the reports'. Each must hold one
``node-loss`` naming node-1 (its rank) at the step of the kill (``expected``, ``checks``),
and nothing else: not the save that failed because the peer died, not a straggler on the
healthy node. ``resumed_on`` (the nodes of the attempt after the kill, from the rank files)
is the replay's own measurement.
"""

from __future__ import annotations

import glob
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
from steadytrain.testing.incidents.continuation import (
    compare,
    fetched_lines,
    final,
    measured,
    rank_nodes,
)
from steadytrain.testing.incidents.elastic import (
    EVERY,
    KILL_AT,
    NNODES,
    STEPS,
    add_spare,
    committed_steps,
    kill_mid_run,
    memory_snapshots,
    restores,
    settings,
    start_job,
)
from steadytrain.testing.incidents.expect import expectation, judge, node_ranks
from steadytrain.testing.nodes import NodeHarness

__all__ = [
    "EVERY",
    "FIX_EVERY",
    "KILL_AT",
    "MEMORY_EVERY",
    "NNODES",
    "REL_TOL",
    "STEPS",
    "expected",
    "replay",
]

MEMORY_EVERY = 1  # the with-fix run's memory-tier snapshot interval (steps)
# Its durable interval: two tiers, memory often and durable rarely. Beyond the kill (near
# step KILL_AT), so the newest good point when the spare starts can only be in memory (a
# durable save of the kill's very step would otherwise tie with memory, or beat a memory
# generation whose peer copy was still in flight, and the spare would read storage).
FIX_EVERY = STEPS  # the final step's save only: no durable point however late the kill lands
# Every step from 3 to the last but one waits 0.3 s for data (elastic.FAULTS stops at
# KILL_AT + 3): the kill is held at the step seen, but a test process the machine starves
# sees it late, and a job that ran its fast steps meanwhile had finished (CI of b1c3fab:
# held at step 16 of 16). Uniform on every rank: no straggler, and a 16-step run completes
# no baseline for a shared slowdown.
PACED = "slow_read_at_steps=" + ",".join(map(str, range(3, STEPS))) + ";slow_read_s=0.3"
REL_TOL = 1e-4  # losses of 1-rank steps against 2-rank ones (summation order only)


def expected(run_dir: str, victim: str, killed_at: int) -> dict[str, Any]:
    """One ``node-loss`` naming ``victim`` (its rank in the first attempt) at the step the
    kill came (``killed_at``: the newest step any rank had traced then): the victim's own
    last step may be one behind the others', or one ahead (a step may complete between
    reading the trace and the SIGKILL)."""
    near = (killed_at - 1, killed_at + 1)
    return expectation("node-loss", [victim], node_ranks(run_dir), near)


def resumed_on(run_dir: str) -> list[str]:
    """The nodes of the attempt after the first (from the rank files)."""
    return sorted(node_ranks(run_dir, attempt=1))


def _clear(path: str) -> None:
    """Empty a node's cache (the tmpfs mount point itself stays)."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def _smallest_token_file(dataset: str) -> int:
    sizes = [
        os.path.getsize(p)
        for p in glob.glob(os.path.join(dataset, "**", "*.tokens"), recursive=True)
    ]
    return min(sizes, default=0)


def _log_text(job: IncidentJob, node: str) -> str:
    with open(job.log_path(node), errors="replace") as f:
        return f.read()


def replay(workdir: str, *, log: Log) -> dict[str, Any]:
    """Reference, without-fix and with-fix runs on a fresh harness under ``workdir``."""
    t0 = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    local = small_shards(os.path.join(workdir, "dataset"))
    h = NodeHarness(os.path.join(workdir, "harness"), nodes=2, cache_size="32M", log=log)
    with h:
        url = h.put_dataset(local, "small-shards")
        node0, node1 = h.nodes[:2]

        log(f"[node-loss] reference: 2 nodes, {STEPS} steps, no failure")
        ref_dir = os.path.join(workdir, "reference")
        start_job(h, [node0, node1], ref_dir, settings(url), faults="").wait(timeout=300)
        # What the plain 2-node run shows of the nodes: each rank on its own node, each
        # node's shards read through its own link into its own cache (emptied next).
        ref_nodes = {
            "rank_nodes": rank_nodes(ref_dir),
            "link_bytes": {n.name: n.link.down.bytes for n in (node0, node1)},
            "cache_files": {
                n.name: sum(len(f) for _, _, f in os.walk(n.cache_dir)) for n in (node0, node1)
            },
        }

        log(f"[node-loss] without the fix: node-1 killed at step {KILL_AT}, no spare")
        for n in (node0, node1):
            _clear(n.cache_dir)
        naive_dir = os.path.join(workdir, "without_fix")
        naive_job = start_job(h, [node0, node1], naive_dir, settings(url), faults=PACED)
        killed_at = {"without_fix": kill_mid_run(h, naive_job, node1, log, hold=True)}

        spare = h.add_node()
        staged = h.stage(spare, url)
        if staged.get("verified") is not True:
            raise RuntimeError(f"stage on {spare.name} did not verify: {staged}")
        link_after_stage = spare.link.down.bytes
        log(f"[node-loss] with the fix: {spare.name} staged ({staged['shards']} shards, "
            f"{staged['bytes']} bytes), its agent waits as a spare")  # fmt: skip
        for n in (node0, node1):
            _clear(n.cache_dir)
        fixed_dir = os.path.join(workdir, "with_fix")
        # The fix is the spare and the memory tier: a snapshot every step, a copy on the
        # other node (node-1's on node-0), so the spare comes back from node-0's memory.
        job = start_job(
            h,
            [node0, node1],
            fixed_dir,
            settings(url, every=FIX_EVERY, memory_every=MEMORY_EVERY),
            faults=PACED,
        )
        add_spare(job, spare, log)
        # Held from the step seen to the kill: a job of fast steps ran from the asked step
        # 6 to 13 before it (CI of b70aad4), past a durable checkpoint then at 10.
        # What node-0's memory held when node-1 died: its own copies and node-1's.
        held: dict[int, list[int]] = {}
        killed_at["with_fix"] = kill_mid_run(
            h, job, node1, log, hold=True, before_kill=lambda: held.update(memory_snapshots(node0))
        )
        spare_link_bytes = spare.link.down.bytes - link_after_stage
        spare_fetched = fetched_lines(_log_text(job, spare.name))

        log("[node-loss] building the reports")
        got = reports({"without_fix": naive_dir, "with_fix": fixed_dir, "reference": ref_dir})
        naive, fixed, ref = got["without_fix"], got["with_fix"], got["reference"]
    leftovers = h.leftovers()
    came_back = {"without_fix": restores(naive_dir, naive), "with_fix": restores(fixed_dir, fixed)}
    for run, rows in came_back.items():
        for r in rows:
            log(f"[node-loss] {run}: attempt {r['attempt']} restored step {r['step']} from "
                f"{r['tier']} in {r['seconds'] or 0:.2f} s, {r['steps_lost']} step(s) lost")  # fmt: skip
    # The object store's copy of the dataset is not worth keeping next to the reports.
    shutil.rmtree(os.path.join(workdir, "harness", "seaweed"), ignore_errors=True)
    incidents = incident_rows(naive, "without_fix") + incident_rows(fixed, "with_fix")
    want = {
        "without_fix": [expected(naive_dir, node1.name, killed_at["without_fix"])],
        "with_fix": [expected(fixed_dir, node1.name, killed_at["with_fix"])],
        "reference": [],
    }
    return {
        "incident": "node-loss",
        "mode": h.mode,
        "mode_reason": h.reason,
        "incidents": incidents + incident_rows(ref, "reference"),
        "expected": want,
        "checks": judge(want, incidents + incident_rows(ref, "reference")),
        "goodput": {"without_fix": naive.get("goodput"), "with_fix": fixed.get("goodput")},
        "runs": {
            "without_fix": {
                **run_summary(naive_dir, naive),
                **compare(ref_dir, naive_dir),
                "resumed_on": resumed_on(naive_dir),
                "measured": measured(naive_dir),
                "restores": came_back["without_fix"],
                "committed": committed_steps(naive_dir),
            },
            "with_fix": {
                **run_summary(fixed_dir, fixed),
                **compare(ref_dir, fixed_dir),
                "resumed_on": resumed_on(fixed_dir),
                "measured": measured(fixed_dir),
                "restores": came_back["with_fix"],
                "committed": committed_steps(fixed_dir),
                # {owner rank: steps} of the snapshots in node-0's memory at the kill
                "node0_memory_at_kill": {str(k): v for k, v in held.items()},
            },
        },
        # The uninterrupted 2-node run both are compared with: a clean run for the report.
        "reference": {
            **run_summary(ref_dir, ref),
            "weights_sha256": final(ref_dir)["weights"],
            "final_step": final(ref_dir)["step"],
            **ref_nodes,
        },
        "spare": {
            "node": spare.name,
            "staged": {k: staged.get(k) for k in ("shards", "bytes", "bytes_fetched", "verified")},
            "fetched_after_stage": spare_fetched,
            # What its link carried after stage: the manifest (each process reads it), and
            # any shard file would add at least the smallest one's size.
            "link_bytes_after_stage": spare_link_bytes,
            "manifest_bytes": os.path.getsize(os.path.join(local, "manifest.json")),
            "smallest_shard_file_bytes": _smallest_token_file(local),
        },
        "seconds": time.monotonic() - t0,
        "steps": STEPS,
        "kill_at_step": KILL_AT,
        "memory_every_steps": {"without_fix": 0, "with_fix": MEMORY_EVERY},
        "durable_every_steps": {"without_fix": EVERY, "with_fix": FIX_EVERY},
        "killed_at": killed_at,  # the newest step traced when the kill came, per run
        "nnodes": NNODES,
        "dataset": url,
        "leftovers": leftovers,
    }  # fmt: skip
