"""The diagnosis matrix's CPU-quota straggler: one node's processes are held to a fraction
of a core from step ``FAULT_AT`` on, the way a Slurm job's or a container's CPU limit slows
one node of a cluster (``NodeHarness.cpu_quota``: a cgroup v1 quota; the node sees its own
cgroup, so its rank records how long the kernel throttled it).

The other ranks wait for that rank in every all-reduce, and rank 0's ledger books the wait
as compute. The report must name a ``host-contention`` incident on that node (its own
cgroup throttled it; the run queue of the shared machine is no higher there than on the
others) and charge what it cost (``straggler_compute``).
"""

from __future__ import annotations

from typing import Any

from steadytrain.testing.incidents.expect import expectation, node_ranks
from steadytrain.testing.nodes import Node, NodeHarness

__all__ = ["QUOTA_CORES", "expected", "lift", "throttle"]

# A twentieth of one core: far below what a rank of the tiny job gets on the loaded 2-core
# machine. At a fifth of a core a rank of a 3-node job was not throttled at all (its fair
# share was already less); at a tenth, the suite's CI run missed it once (no incident), and
# with 24 busy processes beside the job its forward pass led 7.0, 4.9, 2.9 and then 1.0 x in
# the four judged windows: the quota bound less as the machine's fair share fell towards it.
# At a twentieth, under the same load: 5.5, 7.7, 28 and 15 x, its cgroup throttled 81 %.
QUOTA_CORES = 0.05
DETECT_STEPS, TAIL_STEPS = 8, 6


def throttle(h: NodeHarness, nodes: list[Node]) -> None:
    for n in nodes:
        h.cpu_quota(n, QUOTA_CORES)


def lift(h: NodeHarness, nodes: list[Node]) -> None:
    for n in nodes:
        h.cpu_quota(n, None)


def expected(
    run_dir: str, nodes: list[str], at: int, steps: int, landed: int | None = None
) -> dict[str, Any]:
    """One ``host-contention`` incident on ``nodes`` (their ranks), from about ``at`` on
    to the end (the quota stays). ``landed``: the newest step traced once ``throttle``
    returned. The quota binds somewhere between the two reads: moving a node's processes
    into its cgroup took the loaded harness ~0.6 s, seven steps of this job (the suite's
    quiet run: asked at step 4, the rank slowed at step 12, the report said 13), so the
    onset may come up to ``DETECT_STEPS`` after ``landed``, never before ``at``."""
    start = max(at, landed if landed is not None else at)
    return expectation(
        "host-contention",
        nodes,
        node_ranks(run_dir),
        (at, start + DETECT_STEPS),
        (steps - TAIL_STEPS, steps),
    )
