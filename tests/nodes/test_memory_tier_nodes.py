"""The checkpoint memory tier (issue 28) on the node harness: each failure comes back from
the newest good recovery point, bit for bit.

One elastic 2-node job (``elastic.py``, as the node-loss replay runs it: ``steadytrain
train`` under torchrun, one rank per node) with a memory-tier snapshot every step
(``checkpoint.memory.every_steps=1``). Each node's snapshots live in its own tmpfs
(``NODE_MEMORY``, exported as ``STEADYTRAIN_MEMORY_DIR``), and ``NodeHarness.kill`` empties
it, so no case can pass by reading a dead node's memory. Every case is compared with one
uninterrupted run of the same job (a module fixture): the same loss at every step (``==``),
the same sample ids, the same SHA-256 of the final weights.

- (a) one worker process SIGKILLed (its node lives): torchrun restarts the workers, which
  come back from their own node's memory (``local-memory``), at most one step lost;
- (b) a node killed, a spare waiting in the rendezvous: the spare's state comes from the
  surviving node's memory (``peer-memory``), nothing durable read. That is the node-loss
  replay's with-fix run (the same elastic job: tests/nodes/test_replay_node_loss.py,
  ``test_the_spare_comes_back_from_its_peers_memory_and_without_it_from_durable`` and
  ``test_with_a_staged_spare_the_continuation_is_bit_exact``), not run twice;
- (c) both nodes killed (each held the other's copies) and the job relaunched on them with
  their memory gone: the durable checkpoint (``durable``).

SIGKILL during a snapshot write or a peer transfer (never a torn generation) is the core's
distributed tests' (tests/dist), at the process level.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
from typing import Any

import psutil
import pytest

from steadytrain.checkpoint.memory.store import store_key
from steadytrain.testing import netns
from steadytrain.testing.incidents.common import (
    TINY_SETTINGS,
    read_trace,
    report,
    small_shards,
    train_args,
)
from steadytrain.testing.incidents.continuation import compare
from steadytrain.testing.incidents.elastic import (
    FAULTS,
    KILL_AT,
    NNODES,
    RDZV,
    committed_steps,
    memory_snapshots,
    restores,
    settings,
    start_job,
)
from steadytrain.testing.nodes import Node, NodeHarness

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(600)]

STEPS = 12
DURABLE_EVERY = 4  # a durable checkpoint at step 4 before each kill (at step >= KILL_AT)
JOB_ID = "memtier"  # one job identity across (c)'s relaunch: its snapshots' key is the same


def _settings(url: str, *, every: int = DURABLE_EVERY) -> list[str]:
    return [
        *settings(url, steps=STEPS, every=every, memory_every=1),
        f"checkpoint.job_id={JOB_ID}",
    ]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def url(harness: NodeHarness, tmp_path_factory: pytest.TempPathFactory) -> str:
    local = small_shards(str(tmp_path_factory.mktemp("memtier-ds") / "ds"))
    return harness.put_dataset(local, "memtier")


@pytest.fixture(scope="module")
def reference(harness: NodeHarness, url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The uninterrupted run every case is compared with (no slow reads: timing only)."""
    run_dir = str(tmp_path_factory.mktemp("memtier") / "reference")
    start_job(harness, harness.nodes[:2], run_dir, _settings(url), faults="").wait(timeout=300)
    return run_dir


def _newest_traced(run_dir: str) -> int:
    return max((r["step"] for r in read_trace(run_dir)), default=0)


def _bit_exact(reference: str, run_dir: str) -> None:
    got = compare(reference, run_dir)
    assert got["final_step"] == STEPS, got
    assert got["sample_ids_differ_at"] == [] and got["loss_differs_at_same_world"] == [], got
    assert got["steps_on_other_world"] == [], got  # 2 ranks throughout
    assert got["weights_equal"] and got["bit_exact"], got


def test_each_node_has_its_own_memory_and_a_kill_empties_it(harness: NodeHarness) -> None:
    """The harness's side of the contract: a size-limited tmpfs per node (not a directory
    the nodes share), exported to its processes, and lost with the node."""
    node0, node1 = harness.nodes[:2]
    assert node0.memory_dir != node1.memory_dir
    with open("/proc/mounts") as f:
        mounts = f.read()
    for node in (node0, node1):
        assert node.memory_tmpfs and f" {node.memory_dir} tmpfs " in mounts
        assert node.env["STEADYTRAIN_MEMORY_DIR"] == node.env["NODE_MEMORY"] == node.memory_dir
    # A process on each node writes into "its memory" as the environment names it.
    write = (
        "import os, sys, time\n"
        "d = os.path.join(os.environ['STEADYTRAIN_MEMORY_DIR'], 'k', 'rank00000')\n"
        "os.makedirs(d, exist_ok=True)\n"
        "open(os.path.join(d, 'step-000000001.snap'), 'wb').write(b'x' * 4096)\n"
        "print('ready', flush=True); time.sleep(600)\n"
    )
    procs = [
        harness.popen(n, [sys.executable, "-c", write], stdout=-1, text=True)
        for n in (node0, node1)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    assert memory_snapshots(node0) == memory_snapshots(node1) == {0: [1]}
    killed = harness.kill(node1)
    assert procs[1].pid in killed and procs[1].poll() is not None
    assert os.listdir(node1.memory_dir) == []  # its RAM went with it
    assert (
        memory_snapshots(node0) == {0: [1]} and procs[0].poll() is None
    )  # the other node's did not
    harness.kill(node0)
    assert os.listdir(node0.memory_dir) == []


def _worker(job: Any, node: Node) -> psutil.Process:
    """The training process that ``node``'s torchrun agent started."""
    workers = job.h.workers(node, job.agents[node.name])
    assert len(workers) == 1, [c.cmdline() for c in workers]
    return workers[0]


def test_a_killed_worker_comes_back_from_its_own_nodes_memory(
    harness: NodeHarness, url: str, reference: str, tmp_path
) -> None:
    node0, node1 = harness.nodes[:2]
    run_dir = str(tmp_path / "worker")
    job = start_job(harness, [node0, node1], run_dir, _settings(url))
    job.wait_for_step(KILL_AT, timeout=300)
    worker = _worker(job, node1)
    at = _newest_traced(run_dir)
    worker.send_signal(signal.SIGKILL)
    _log(f"[memtier] killed {node1.name}'s worker (pid {worker.pid}) at step ~{at}")
    job.wait(timeout=300)  # torchrun restarted the workers; both agents finish the job

    [r] = restores(run_dir)
    assert r["tier"] == "local-memory", r
    assert 0 <= r["steps_lost"] <= 1, r
    assert r["step"] >= at - 2 and r["step"] > DURABLE_EVERY, (r, at)  # newer than durable
    _bit_exact(reference, run_dir)


def test_a_node_and_its_peer_lost_fall_back_to_durable(
    harness: NodeHarness, url: str, reference: str, tmp_path
) -> None:
    node0, node1 = harness.nodes[:2]
    run_dir = str(tmp_path / "pair")
    job = start_job(harness, [node0, node1], run_dir, _settings(url))
    job.wait_for_step(KILL_AT, timeout=300)
    at = _newest_traced(run_dir)
    for node in (node1, node0):  # each held the other's copies
        harness.kill(node)
    job.wait(timeout=60, expect={node0.name: None, node1.name: None})
    assert os.listdir(node0.memory_dir) == os.listdir(node1.memory_dir) == []
    durable = committed_steps(run_dir)
    assert durable and max(durable) >= DURABLE_EVERY, durable
    _log(f"[memtier] killed both nodes at step ~{at}; committed durable steps {durable}")

    # The job comes back on the same machines (disks kept, RAM lost), under a new
    # rendezvous (the old one's seats belong to dead agents) and the same job identity.
    args = train_args([*TINY_SETTINGS, f"run_dir={run_dir}", *_settings(url)])
    agents = [
        harness.torchrun(n, 1, args, run_id="pair-again", nnodes=NNODES, rdzv_conf=RDZV,
                         log_path=f"{run_dir}-{n.name}-again.log",
                         env={"STEADYTRAIN_FAULTS": FAULTS})
        for n in (node0, node1)
    ]  # fmt: skip
    for a, n in zip(agents, (node0, node1), strict=True):
        assert a.wait(timeout=300) == 0, open(f"{run_dir}-{n.name}-again.log").read()[-4000:]

    r = restores(run_dir)[-1]  # the relaunch's (node-0 had no time to restart alone)
    assert r["tier"] == "durable" and r["step"] == max(durable), (r, durable)
    assert 0 <= r["steps_lost"] <= DURABLE_EVERY + 1, r
    _bit_exact(reference, run_dir)


ATTACKER = 65534  # another local user (nobody), played by the test's root


def _kill_processes(harness: NodeHarness, node: Node) -> None:
    """Every process of ``node`` SIGKILLed (a job killed for good), its memory kept: unlike
    ``harness.kill``, the machine lives on, with the dead job's snapshots in its tmpfs."""
    killed: set[int] = set()
    while found := harness.pids(node) - killed:
        netns.kill_pids(found)
        killed |= found


def _plant(node: Node, key: str, victim: str) -> tuple[str, str]:
    """What another user leaves in ``node``'s memory (as root plays them): a valid snapshot
    of theirs, named as a newer step of rank 0 than any; and a folder of theirs named as
    the copies of a rank, holding a link to ``victim``. Returns (the file, the folder)."""
    owner0 = os.path.join(node.memory_dir, key, "rank00000")
    newest = max(glob.glob(os.path.join(owner0, "step-*.snap")))
    planted = os.path.join(owner0, "step-000000099.snap")
    shutil.copyfile(newest, planted)
    os.chown(planted, ATTACKER, ATTACKER)
    folder = os.path.join(node.memory_dir, key, "rank00002")
    os.mkdir(folder)
    os.symlink(victim, os.path.join(folder, "step-000000099.snap"))
    os.chmod(folder, 0o777)
    os.chown(folder, ATTACKER, ATTACKER)
    return planted, folder


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user")
def test_a_reused_run_dir_and_another_users_files_are_never_restored(
    harness: NodeHarness, url: str, reference: str, tmp_path
) -> None:
    """Issue 40's shared-node attack and reused run dir, on two nodes: a run snapshots every
    step and is killed for good (every process of both nodes; their memory stays), its run
    directory is removed, and another user leaves a snapshot file and a folder of theirs in
    the job's memory folder (the folder with a link to an unrelated 0600 file). A new run
    under the same run directory and job id must start from step 0 and train exactly as the
    uninterrupted reference; every stale or foreign entry is passed over by name, on both
    nodes, and `steadytrain report`'s restores say why each was."""
    node0, node1 = harness.nodes[:2]
    run_dir = str(tmp_path / "reused")
    job = start_job(harness, [node0, node1], run_dir, _settings(url), faults="")
    job.wait_for_step(KILL_AT, timeout=300)
    for node in (node0, node1):
        _kill_processes(harness, node)
    job.wait(timeout=60, expect={node0.name: None, node1.name: None})
    held = {n.name: memory_snapshots(n) for n in (node0, node1)}
    assert all(sorted(h) == [0, 1] for h in held.values()), held  # own copies and the peer's
    key = store_key(JOB_ID, os.path.join(run_dir, "checkpoints"))  # as predictable to all
    shutil.rmtree(run_dir)  # rm -rf RUN: the identity and the durable checkpoints go
    victim = str(tmp_path / "victim")
    with open(victim, "wb") as f:
        f.write(b"an unrelated file")
    os.chmod(victim, 0o600)
    planted, folder = _plant(node0, key, victim)
    _log(f"[memtier] reused {run_dir}; planted {planted} and {folder}; stale copies {held}")

    start_job(harness, [node0, node1], run_dir, _settings(url), faults="").wait(timeout=300)
    assert restores(run_dir) == []  # no attempt restored anything
    _bit_exact(reference, run_dir)  # a fresh start: nothing of the old run leaked in
    with open(victim, "rb") as f:
        assert f.read() == b"an unrelated file"  # never written through

    rep = report(run_dir, plots=False)  # its restores, not its pictures
    why = [(p["node"], _last2(p["path"]), p["reason"]) for p in rep["restores_passed_over"]]
    stale = {(n, f) for n, f, r in why if "written by another run (nonce" in r}
    want = {(n, f"rank{o:05d}/step-{s:09d}.snap") for n, h in held.items() for o in h for s in h[o]}
    assert stale == want, why  # every old copy, on both nodes
    foreign = {(n, f) for n, f, r in why if "not owned by this user (owner uid 65534" in r}
    assert foreign == {(node0.name, "rank00000/step-000000099.snap")}, why  # never read
    assert (node0.name, f"{key}/rank00002") in {
        (n, f) for n, f, r in why if "owned by uid 65534, not by this user" in r
    }, why  # never listed


def _last2(path: str) -> str:
    return "/".join(path.split("/")[-2:])
