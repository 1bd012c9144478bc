"""What the diagnosis engine returns: one ``Incident`` per fault, in a fixed vocabulary.

An incident is what an on-call engineer acts on: which kind of fault (``KINDS``), where
(``nodes``, ``ranks``), when (``first_step`` .. ``last_step``, ``t`` of its first evidence),
what it cost (``lost_s``, wall seconds of the job), the numbers behind it (``evidence``) and
what to do (``advice``). The vocabulary is documented in docs/monitoring.md ("Incidents").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["KINDS", "Incident"]

# kind -> what to do about it. The engine may append specifics (the node, the frame) to the
# advice; the kind's own words always come first so that docs and output agree.
KINDS: dict[str, str] = {
    "storage": (
        "Reads got slower or the cache stopped hitting on the named node(s): check the cache "
        "hit ratio and read p99 in the ranks table, whether shards were evicted from a tiered "
        "file system or node-local cache (re-stage them with `steadytrain stage`), and the "
        "object store's latency and throttling from that node."
    ),
    "dataloader": (
        "The loader cannot keep up while storage and memory look flat: raise prefetch depth "
        "or workers, move tokenization/decoding offline, and profile time inside next() on "
        "the named rank."
    ),
    "loader-memory": (
        "Loader memory grows with the step count: look for an index, cache or list that "
        "grows per step (sample indices built for all iterations, unbounded prefetch, leaked "
        "batches), watch /dev/shm and worker RSS; memory must not grow with steps."
    ),
    "compute": (
        "The named rank's own compute got slower (its forward pass, data wait flat) while "
        "nothing on its host set it apart (no CPU quota throttled it, its host no busier "
        "than the others'): check GPU clocks and thermal throttling (nvidia-smi -q -d "
        "PERFORMANCE), ECC/Xid errors in dmesg and NCCL bandwidth on that node; on a CPU "
        "run, the rank's threads and core affinity and the CPU's frequency."
    ),
    "host-contention": (
        "The rank's CPUs were withheld: its own cgroup's CPU quota throttled it (a Slurm "
        "job's or a container's limit: raise it, or run fewer threads), or its host was "
        "busier than the other ranks' (run queue above the core count, steal): look for "
        "other processes on the node (top), more threads than cores (ranks per node x "
        "OMP_NUM_THREADS) and a throttled virtual machine. Not a hardware fault of the rank."
    ),
    "node-loss": (
        "A node left the job: check its health (dmesg, the scheduler's node state) before it "
        "rejoins; keep a staged spare (`steadytrain stage`) so the seat is filled at once."
    ),
    # crash, hang and node-loss advice then says what happened after (the job restarted,
    # or it stopped there: diagnose/job_state.state_advice)
    "hang": (
        "A rank stopped making progress: read its stack under RUN_DIR/hangs/, check the named "
        "node for a stopped process, a dead link or a stuck device."
    ),
    "crash": "A rank died: read the named rank's log on the named node for the exception.",
    "checkpoint": (
        "A checkpoint save failed or blocked the loop: see the cause in the evidence (a peer "
        "gone, the disk, the store); when saves block, use async_mode='thread' and "
        "`steadytrain plan` for the interval."
    ),
    "data-order": (
        "The loss jumps from step to step far more than its own trend explains, and the data "
        "is read in order: shuffle globally (shuffle='global') or pre-shuffle the dataset "
        "offline (`steadytrain shuffle`)."
    ),
    # then how the loop ended: the job stopped, is still restarting, or got past it
    "restart-loop": (
        "The job restarted again and again without getting past the same fault: restarting "
        "does not help; fix the cause named in the evidence, then resume."
    ),
}


@dataclass
class Incident:
    """One fault, as the report, the live alerts and ``demo --incident`` print it."""

    kind: str
    nodes: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    lost_s: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    advice: str = ""
    message: str = ""
    t: float | None = None  # wall time (epoch s) of the first evidence
    attempt: int | None = None  # the attempt it happened in, where one does

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown incident kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not self.advice:
            self.advice = KINDS[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
