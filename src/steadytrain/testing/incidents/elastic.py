"""The elastic job of the node-loss replay and the memory-tier node tests: ``--nnodes 1:2``,
one rank per node, up to 3 restarts, a spare that waits in the rendezvous, a node killed
mid-run, and what each restart restored (``restores``).

Shared by ``node_loss`` (``steadytrain demo --incident node-loss``) and
tests/nodes/test_memory_tier_nodes.py, so both run the same job the same way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil

from steadytrain.testing.incidents.common import (
    IncidentJob,
    Log,
    read_trace,
    report,
)
from steadytrain.testing.nodes import Node, NodeHarness

__all__ = [
    "EVERY",
    "FAULTS",
    "KILL_AT",
    "NNODES",
    "RDZV",
    "STEPS",
    "ElasticJob",
    "add_spare",
    "committed_steps",
    "held_workers",
    "kill_mid_run",
    "memory_snapshots",
    "restores",
    "settings",
    "start_job",
]

STEPS, KILL_AT, NNODES = 16, 6, "1:2"
EVERY = 2  # checkpoint interval (steps)
# Seats expire after keep_alive_interval x keep_alive_max_attempt = 8 s; a round with MIN
# nodes waits last_call_timeout for latecomers. The first round too: both nodes must make
# it, or the job starts on one and is not the run it is compared with. 6 s was too short
# once in CI, where the other replay lane and the suite load both cores (node-1's agent
# arrived late and the with-fix run started on 1 node); only the run without a spare pays
# the wait again, once, after the kill. 12 s was too short once too (CI of 29c5e1c: an HF
# Trainer job's node-1 agent, importing transformers beside the replays, came late and the
# job started on 1 node): 30 s, torch's own default.
RDZV = "last_call_timeout=30,keep_alive_interval=2,keep_alive_max_attempt=4"
# The steps around the kill each wait 0.3 s for data, so the kill lands mid-run (each such
# fault fires once per run: the steps redone after the restart do not wait again).
FAULTS = "slow_read_at_steps=" + ",".join(map(str, range(3, KILL_AT + 4))) + ";slow_read_s=0.3"


def settings(
    url: str, *, steps: int = STEPS, every: int = EVERY, memory_every: int = 0
) -> list[str]:
    """The job's settings: durable checkpoints every ``every`` steps, memory-tier snapshots
    every ``memory_every`` (0: the tier off, the setting left out)."""
    out = [
        f"data.dataset={url}",
        "data.cache_dir=$NODE_CACHE",  # expanded by each node's process: its own tmpfs
        f"train.max_steps={steps}",
        f"train.elastic_nnodes={NNODES}",
        f"checkpoint.every_steps={every}",
        "checkpoint.keep_last=100",
    ]
    # The tier's directory is each node's own (STEADYTRAIN_MEMORY_DIR, set by the harness).
    return out + ([f"checkpoint.memory.every_steps={memory_every}"] if memory_every else [])


class ElasticJob(IncidentJob):
    """The elastic job (``--nnodes NNODES``, up to 3 restarts) on ``nodes``; it keeps its
    settings and faults for a spare's agent (``add_spare``)."""

    def __init__(
        self,
        h: NodeHarness,
        nodes: Sequence[Node],
        run_dir: str,
        job_settings: Sequence[str],
        faults: str = FAULTS,
        argv: Sequence[str] | None = None,
    ) -> None:
        super().__init__(
            h,
            nodes,
            run_dir,
            job_settings,
            nnodes=NNODES,
            max_restarts=3,
            rdzv_conf=RDZV,
            env={"STEADYTRAIN_FAULTS": faults},
            argv=argv,
        )
        self.settings, self.faults = list(job_settings), faults


def start_job(
    h: NodeHarness,
    nodes: Sequence[Node],
    run_dir: str,
    job_settings: Sequence[str],
    faults: str = FAULTS,
    argv: Sequence[str] | None = None,
) -> ElasticJob:
    """The job on ``nodes`` (the reference runs without the slow reads: timing only);
    ``argv``: another script than ``steadytrain train`` (its settings then unused)."""
    return ElasticJob(h, nodes, run_dir, job_settings, faults, argv)


def _join(job: ElasticJob, node: Node) -> None:
    """Start ``node``'s agent for the running ``job`` (same arguments as its other agents)."""
    job.nodes.append(node)
    job.agents[node.name] = job.h.torchrun(
        node,
        1,
        job.argv,
        run_id=os.path.basename(job.run_dir),
        nnodes=NNODES,
        max_restarts=3,
        rdzv_conf=RDZV,
        log_path=job.log_path(node.name),
        env={"STEADYTRAIN_FAULTS": job.faults},
        fork=job.fork_agents,
    )


def _rdzv_state(h: NodeHarness, run_id: str) -> Any:
    """The job's rendezvous state as torch's c10d backend keeps it in the harness's store
    (torch's private structure: if torch changes it, this fails loudly)."""
    import pickle

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    assert h.store is not None, "start() the harness first"
    got = C10dRendezvousBackend(h.store, run_id).get_state()
    return None if got is None else pickle.loads(got[0])


def _until(pred: Any, what: str, job: IncidentJob, timeout: float = 300) -> None:
    """Poll ``pred()``; a failed agent or the time-out raises, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not pred():
        job.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job.run_dir}: {what} not seen in {timeout:.0f} s")
        time.sleep(0.1)


def add_spare(job: ElasticJob, spare: Node, log: Log) -> None:
    """Start ``spare``'s agent once the job's first round is full, and make sure it waits in
    the rendezvous' redundancy list before anything fails: a spare still starting up when
    the seat frees would let the job restart on 1 node, then again on 2 (not bit-exact)."""
    run_id = os.path.basename(job.run_dir)

    def state() -> Any:
        return _rdzv_state(job.h, run_id)

    def full() -> bool:
        st = state()
        return st is not None and st.complete and len(st.participants) == 2

    def waits() -> bool:
        st = state()
        return st is not None and any(
            n.pid == job.agents[spare.name].pid for n in st.redundancy_list
        )

    _until(full, "the first rendezvous round with 2 nodes", job)
    # Held from its first step until the spare waits: starting the spare's agent took longer
    # than the whole job once (CI of 00ba558: "holding 0 worker(s)", the job done, and the
    # spare found the rendezvous closed).
    job.wait_for_step(1, timeout=300)
    with held_workers(job.h, job) as held:
        _join(job, spare)
        if not waits():
            log(f"[node-loss] holding {held} worker(s) until {spare.name} waits as a spare")
            _until(waits, f"{spare.name} in the redundancy list", job)


def kill_mid_run(
    h: NodeHarness,
    job: IncidentJob,
    victim: Node,
    log: Log,
    *,
    at_step: int = KILL_AT,
    hold: bool = False,
    before_kill: Callable[[], object] | None = None,
) -> int:
    """Kill ``victim`` once the job has traced ``at_step``; wait for the others to finish.
    Returns the last step the job had traced when the kill came. ``hold``: stop every
    worker of the job (SIGSTOP; not the agents, whose heartbeats go on) from the moment the
    step is seen until the victim is dead, so a job of fast steps cannot finish between the
    two on a loaded machine (CI: a Lightning job of 24 steps at ~0.14 s each was seen at
    step 16 for a kill asked at 6, and had ended when the kill landed; the node-loss
    replay's was killed at step 13 for 6, past its first durable checkpoint at 10).
    ``before_kill``: called right before the kill, inside the hold."""
    job.wait_for_step(at_step, timeout=300)
    with held_workers(h, job) if hold else contextlib.nullcontext():
        at = max((r["step"] for r in read_trace(job.run_dir)), default=0)
        if before_kill is not None:  # what to look at as the victim dies (the job held)
            before_kill()
        h.kill(victim)
    log(f"[node-loss] {os.path.basename(job.run_dir)}: killed {victim.name} at step ~{at}")
    job.wait(timeout=300, expect={victim.name: None})
    return at


@contextlib.contextmanager
def held_workers(h: NodeHarness, job: IncidentJob) -> Iterator[int]:
    """Stop (SIGSTOP) every training process of ``job`` for the block -- fresh or forked from
    a node's warm process (``h.workers``), not the agents, whose heartbeats go on -- and
    resume the ones still alive after it; yields how many were held."""
    by_name = {n.name: n for n in h.nodes}
    held = [w for name, a in job.agents.items() for w in h.workers(by_name[name], a)]
    if not held:  # an example script's workers (no "steadytrain" in their command line):
        for a in job.agents.values():  # the agents' own children: torchrun's workers
            with contextlib.suppress(psutil.NoSuchProcess):
                held += psutil.Process(a.pid).children()
    for w in held:
        with contextlib.suppress(psutil.NoSuchProcess):
            w.suspend()
    try:
        yield len(held)
    finally:
        for w in held:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.resume()


def restores(run_dir: str, rep: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each restart's restore, ``[{attempt, step, tier, seconds, steps_lost, ...}]``: the
    report's ``restores`` (``rep``: its ``report --json``; None: ``steadytrain report`` is
    run here, without plots: only the numbers are read). The harness computes none of it:
    what it prints is what the product found."""
    rep = report(run_dir, plots=False) if rep is None else rep
    got = rep.get("restores")
    if not isinstance(got, list):
        raise RuntimeError(f"steadytrain report {run_dir} --json has no restores list")
    return got


def memory_snapshots(node: Node) -> dict[int, list[int]]:
    """{owner rank: steps} of the complete snapshot files in ``node``'s memory (its own
    copies and the ones it holds for a peer)."""
    out: dict[int, list[int]] = {}
    for path in glob.glob(os.path.join(node.memory_dir, "*", "rank*", "step-*.snap")):
        owner = int(os.path.basename(os.path.dirname(path)).removeprefix("rank"))
        step = int(os.path.basename(path).removeprefix("step-").removesuffix(".snap"))
        out.setdefault(owner, []).append(step)
    return {k: sorted(v) for k, v in sorted(out.items())}


def committed_steps(run_dir: str) -> list[int]:
    """Steps of the durable checkpoints committed under ``RUN_DIR/checkpoints``."""
    from steadytrain.checkpoint.commit import COMMIT_NAME, parse_dirname

    root = os.path.join(run_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(
        parsed[0]
        for n in names
        if (parsed := parse_dirname(n)) is not None
        and os.path.exists(os.path.join(root, n, COMMIT_NAME))
    )
