"""A remote checkpoint is downloaded once per node, not once per rank.

Three ranks on two nodes (ranks 0 and 1 share node-a's local directory, rank 2 is alone on
node-b; all three with one host name) restore as spares from the object store (real
SeaweedFS, real gloo processes):

- the ranks of node-a split its files (each downloads a part, together exactly the
  checkpoint once), node-b's one rank downloads all of it, and every rank gets the saved
  weights; nothing is left in the local directories;
- when one rank of node-a cannot write its part, every rank stops with the error naming
  that file (not known to be damaged: no older checkpoint, no fresh start), its mate does
  not report an error of its own, and node-a's download is removed;
- a file damaged in the store is found by whichever rank of the node checks it, and every
  rank falls back to the older checkpoint together;
- ranks of different nodes whose directory is one shared filesystem download it once
  between them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid

import pytest
import s3fs

HERE = os.path.join(os.path.dirname(__file__), "..", "distributed", "checkpoint")
sys.path.insert(0, HERE)
from launch import launch  # noqa: E402

pytestmark = [pytest.mark.s3, pytest.mark.dist, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "node_download_worker.py")


def _run(tmp_path, s3_bucket, opts) -> dict[int, dict]:
    fs = s3fs.S3FileSystem(**opts)
    bucket = s3_bucket.removeprefix("s3://")
    outs: list[str] = []
    failure: list[BaseException] = []

    def go() -> None:
        try:
            outs.extend(launch(WORKER, [str(tmp_path), s3_bucket, json.dumps(opts)], 3, 240))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, with the ranks' output
            failure.append(exc)

    t = threading.Thread(target=go)
    t.start()
    while not (tmp_path / "ready").exists() and t.is_alive():
        time.sleep(0.05)
    if (tmp_path / "ready").exists():
        # the harness damages the store; which rank notices is the product's business
        shard = f"{bucket}/step-00000002/__0_0.distcp"
        data = bytearray(fs.cat_file(shard))
        data[-1] ^= 0xFF  # same size: only the checksum can tell
        fs.pipe_file(shard, bytes(data))
        (tmp_path / "damage").write_text("done")
    t.join()
    if failure:
        raise failure[0]
    results = {}
    for out in outs:
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        r = json.loads(line.removeprefix("RESULT "))
        results[r["rank"]] = r
    return results


@pytest.fixture(scope="module")
def results(s3_server, tmp_path_factory):
    """One run of the three ranks for the three tests (each round starts from empty
    local directories: the rounds do not depend on one another's leftovers)."""
    s3_bucket = f"s3://steady/t-{uuid.uuid4().hex[:10]}"
    tmp_path = tmp_path_factory.mktemp("per-node")
    opts = dict(s3_server.storage_options, skip_instance_cache=True)
    fs = s3fs.S3FileSystem(**opts)
    out = _run(tmp_path, s3_bucket, opts)
    # the checkpoint's files, as its COMMIT lists them, with the sizes the store has
    step2 = f"{s3_bucket.removeprefix('s3://')}/step-00000002"
    listed = [f["path"] for f in json.loads(fs.cat_file(f"{step2}/COMMIT"))["files"]]
    return out, {n: fs.size(f"{step2}/{n}") for n in listed}


def test_each_node_downloads_the_checkpoint_once(results):
    out, sizes = results
    total = sum(sizes.values())
    intact = {r: out[r]["rounds"]["intact"] for r in out}
    for r, got in intact.items():
        assert got.get("step") == 2, (r, got)
        assert got["weights"] == [2.0], (r, got["weights"])
        assert got["left"] == [], (r, got["left"])
    # what each rank asked the store for: node-a's two split the files, node-b's has all
    asked = {r: intact[r]["asked"] for r in intact}
    assert asked[0] and asked[1] and not set(asked[0]) & set(asked[1]), asked
    assert sorted(asked[0] + asked[1]) == sorted(sizes) == asked[2], asked
    a0, a1 = (intact[r]["event"]["bytes_remote"] for r in (0, 1))
    assert a0 > 0 and a1 > 0, (a0, a1)  # both ranks of node-a downloaded a part
    assert a0 + a1 == total, (a0, a1, total)  # together, the checkpoint exactly once
    assert intact[2]["event"]["bytes_remote"] == total  # node-b's one rank: all of it


def test_a_rank_that_cannot_write_its_part_stops_every_rank_naming_the_file(results):
    out, _ = results
    got = {r: out[r]["rounds"]["unwritable"] for r in out}
    for r, g in got.items():
        assert "step" not in g, (r, g)  # neither an older checkpoint nor a fresh start
        msg = g["error"]
        assert "step-00000002 could not be read" in msg, (r, msg)
        assert "rank 1:" in msg and "Nothing was loaded" in msg, (r, msg)
        assert g["weights"] == [-1.0], (r, g["weights"])  # the live state is untouched
        assert g["left"] == [], (r, g["left"])  # node-a's download is removed
    # the error is rank 1's alone: its mate and the other node report none of their own
    assert "rank 0:" not in got[0]["error"] and "rank 2:" not in got[0]["error"]


def test_a_damaged_file_makes_every_rank_fall_back_together(results):
    out, _ = results
    for r in out:
        got = out[r]["rounds"]["damaged"]
        assert got.get("step") == 1, (r, got)
        assert got["weights"] == [1.0], (r, got["weights"])
        skipped = got["event"]["skipped"]
        assert [s["step"] for s in skipped] == [2], skipped
        assert "__0_0.distcp" in skipped[0]["reason"], skipped
        assert "checksum" in skipped[0]["reason"], skipped
        assert got["left"] == [], (r, got["left"])


def test_ranks_of_nodes_sharing_one_filesystem_download_it_once(results):
    out, sizes = results
    got = {r: out[r]["rounds"]["shared"] for r in out}
    for r, g in got.items():
        assert g.get("step") == 1, (r, g)  # step 2 is damaged by now
        assert g["weights"] == [1.0] and g["left"] == [], (r, g)
    step1 = got[0]["asked"] + got[1]["asked"] + got[2]["asked"]
    assert all(got[r]["asked"] for r in got), got  # each of the three fetched a part
    # step 2's files (checksums failed) and step 1's, each asked for once
    assert sorted(step1) == sorted(list(sizes) * 2), step1
