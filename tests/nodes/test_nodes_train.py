"""``steadytrain train`` across harness nodes: one torchrun agent per node, 1 worker each.

Both runs read an ``s3://`` dataset through each node's own link into its own tmpfs cache and
keep their run directory (checkpoints, rank files) on storage every node sees.

- two nodes (``--nnodes 2``) finish; every rank file names the node its rank ran on;
- kill-a-node (``--nnodes 1:2``): node-1 is killed whole mid-run (agent and worker, by PID);
  node-0's agent restarts the job on MIN = 1 node, which resumes from the last checkpoint
  and finishes. Per step, the sample ids (all ranks, rank order) equal the 2-node run's, and
  so do the losses (to 1e-4 relative: one rank sums micro-batch gradients in another order
  than two ranks plus all-reduce); the steps both runs took on 2 nodes are bit-identical.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Iterator

import pytest

from steadytrain.testing.nodes import NodeHarness

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e", "train"))

from harness import BASE_SETTINGS, effective, final, read_trace  # noqa: E402

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(300)]

STEPS = 16
TRAIN = ["-m", "steadytrain.cli", "train", "demo"]  # what torchrun runs on each node
RDZV = "last_call_timeout=4,keep_alive_interval=2,keep_alive_max_attempt=4"


def _settings(run_dir: str, url: str) -> list[str]:
    out = []
    for s in [
        *BASE_SETTINGS,
        f"run_dir={run_dir}",
        f"data.dataset={url}",
        "data.cache_dir=$NODE_CACHE",  # expanded by each node's process: its own tmpfs
        f"train.max_steps={STEPS}",
    ]:
        out += ["--set", s]
    return out


def _wait(pred, what: str, agents) -> None:
    """Poll until ``pred()``; an agent that fails meanwhile fails the test (the test's
    timeout guards a hang: start-up takes what this machine needs)."""
    while not pred():
        for p in agents:
            if p.poll() not in (None, 0):
                raise AssertionError(f"agent {p.args[:4]} exited {p.returncode}: {what}")
        time.sleep(0.1)


def _rank_nodes(run_dir: str) -> dict[int, set[str]]:
    """{rank: the nodes its rank_start records name}, from RUN_DIR/ranks/rank-*.jsonl."""
    out: dict[int, set[str]] = {}
    for path in glob.glob(os.path.join(run_dir, "ranks", "rank-*.jsonl")):
        with open(path) as f:
            for line in f:
                r = json.loads(line) if line.strip() else {}
                if r.get("type") == "rank_start":
                    out.setdefault(r["rank"], set()).add(r["node"])
    return out


@pytest.fixture(scope="module")
def url(harness: NodeHarness, dataset: str) -> str:
    return harness.put_dataset(dataset, "ds")


@pytest.fixture(scope="module")
def two_node_run(harness: NodeHarness, url: str, tmp_path_factory) -> Iterator[str]:
    run_dir = str(tmp_path_factory.mktemp("two-node") / "run")
    logs = tmp_path_factory.mktemp("two-node-logs")
    agents = [
        harness.torchrun(
            n,
            1,
            [*TRAIN, *_settings(run_dir, url)],
            run_id="two-node",
            nnodes="2",
            log_path=str(logs / f"{n.name}.log"),
        )
        for n in harness.nodes[:2]
    ]
    for p, n in zip(agents, harness.nodes, strict=False):
        assert p.wait(timeout=240) == 0, (logs / f"{n.name}.log").read_text()[-6000:]
    yield run_dir


def test_two_nodes_train_and_each_rank_names_its_node(two_node_run: str, harness) -> None:
    assert _rank_nodes(two_node_run) in (
        {0: {"node-0"}, 1: {"node-1"}},
        {0: {"node-1"}, 1: {"node-0"}},
    )
    trace = read_trace(two_node_run)
    assert {r["node"] for r in trace} == {"node-0", "node-1"}
    assert final(two_node_run)["step"] == STEPS
    # Each node read the shards through its own link into its own disk.
    for n in harness.nodes[:2]:
        assert n.link.down.bytes > 0
        assert any(files for _, _, files in os.walk(n.cache_dir)), n.cache_dir


def test_kill_a_node_continues_on_min_nodes(harness, url, two_node_run, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    # Steps 3.. read slowly (0.3 s, once per rank) so the kill lands mid-run.
    faults = "slow_read_at_steps=" + ",".join(map(str, range(3, STEPS + 1))) + ";slow_read_s=0.3"
    node0, node1 = harness.nodes[:2]
    agents = [
        harness.torchrun(
            n,
            1,
            [*TRAIN, *_settings(run_dir, url)],
            run_id="kill-node",
            nnodes="1:2",
            max_restarts=3,
            rdzv_conf=RDZV,
            log_path=str(tmp_path / f"{n.name}.log"),
            env={"STEADYTRAIN_FAULTS": faults},
        )
        for n in (node0, node1)
    ]

    def steps_on(node: str) -> list[int]:
        return [r["step"] for r in read_trace(run_dir) if r["node"] == node]

    _wait(lambda: max(steps_on("node-1"), default=0) >= 6, "step 6 on node-1", agents)
    killed = harness.kill(node1)
    assert agents[1].pid in killed and len(killed) >= 2  # the agent and its worker
    assert agents[0].wait(timeout=240) == 0, (tmp_path / "node-0.log").read_text()[-6000:]

    records = read_trace(run_dir)
    last = max(r["attempt_id"] for r in records)
    assert {(r["node"], r["world"]) for r in records if r["attempt_id"] == last} == {("node-0", 1)}
    ref, got = effective(read_trace(two_node_run)), effective(records)
    assert sorted(got) == list(range(1, STEPS + 1))
    on_two = [s for s in got if got[s]["world"] == 2]
    assert on_two and max(on_two) < STEPS
    for step in range(1, STEPS + 1):
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], f"step {step}"
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-4), f"step {step}"
    for step in on_two:  # same world, same history: exact
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}"
    assert final(run_dir)["step"] == STEPS
