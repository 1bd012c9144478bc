"""Incident replay ``storage``: one node's object-store link slows mid-run.

Two nodes (1 rank each) read an ``s3://`` dataset of many small shards (1,024 tokens: a
``global`` order keeps reaching shards it has not read yet) through their own links. At
step SLOW_AT the harness slows node-1's link (0.1 s each way per request), as when a
tiering file system evicts that node's shards. The same job runs twice:

- **naive**: no schedule-aware prefetch (``data.prefetch_steps=0``), empty node caches: each
  new shard is fetched on demand inside ``next()``. node-1's rank waits on storage and node-0
  waits for it in the all-reduce: the report's straggler incident names node-1 and storage.
- **fixed**: ``steadytrain stage`` warmed each node's cache, and prefetch is on (the default):
  the same slowdown costs nothing, and the report has no incident naming storage or node-1.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from steadytrain.testing.nodes import NodeHarness

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e", "train"))

from harness import BASE_SETTINGS, read_trace  # noqa: E402

pytestmark = [pytest.mark.nodes, pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(420)]

STEPS, SLOW_AT, LATENCY_S = 30, 4, 0.1


def _small_shards(dest: str) -> str:
    """~150k tokens of real text (the stdlib's json and email packages) in 1,024-token
    shards: about 146 shards, most of them first read after SLOW_AT."""
    import sysconfig

    from steadytrain.data.ingest.writer import DatasetWriter

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")))
    files += sorted(glob.glob(os.path.join(stdlib, "email", "*.py")))
    tok = {"type": "bytes", "vocab_size": 257, "eos_id": 256}
    total = 0
    with DatasetWriter(dest, vocab_size=257, eos_id=256, tokenizer=tok, shard_tokens=1024) as w:
        for path in files:
            with open(path, "rb") as f:
                text = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
            # Documents of ~1,000 bytes: a shard closes at a document boundary, so whole
            # files (tens of kB) would each make one shard.
            for doc in np.array_split(text, max(1, text.size // 1000)):
                w.add_document(np.append(doc, 256))
                total += doc.size + 1
            if total >= 150_000:
                break
    return dest


def _clear(path: str) -> None:
    """Empty a node's cache (the tmpfs mount point itself stays)."""
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def _tail(logs: str, node: str) -> str:
    with open(os.path.join(logs, f"{node}.log")) as f:
        return f.read()[-6000:]


def _run(h: NodeHarness, url: str, run_dir: str, logs: str, extra: list[str]) -> dict:
    settings = [
        *BASE_SETTINGS,
        f"run_dir={run_dir}",
        f"data.dataset={url}",
        "data.cache_dir=$NODE_CACHE",
        "data.shuffle=global",
        f"train.max_steps={STEPS}",
        "checkpoint.every_steps=100",  # no saves: the run is about reads
        "monitor.straggler_every_s=0.5",
        *extra,
    ]
    args = ["-m", "steadytrain.cli", "train", "demo"]
    for s in settings:
        args += ["--set", s]
    node0, node1 = h.nodes[:2]
    agents = [
        h.torchrun(
            n,
            1,
            args,
            run_id=os.path.basename(run_dir),
            nnodes="2",
            log_path=os.path.join(logs, f"{n.name}.log"),
        )  # fmt: skip
        for n in (node0, node1)
    ]
    try:
        while max((r["step"] for r in read_trace(run_dir)), default=0) < SLOW_AT:
            for p, n in zip(agents, (node0, node1), strict=True):
                assert p.poll() in (None, 0), _tail(logs, n.name)
            time.sleep(0.05)
        h.slow_storage(node1, latency_s=LATENCY_S)
        for p, n in zip(agents, (node0, node1), strict=True):
            assert p.wait(timeout=300) == 0, _tail(logs, n.name)
    finally:
        h.slow_storage(node1)
    r = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "report", run_dir, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_storage_replay_names_the_node_and_the_fix_removes_it(harness, tmp_path) -> None:
    url = harness.put_dataset(_small_shards(str(tmp_path / "ds")), "small-shards")
    for n in harness.nodes[:2]:
        _clear(n.cache_dir)
    os.makedirs(tmp_path / "naive-logs")
    naive = _run(harness, url, str(tmp_path / "naive"), str(tmp_path / "naive-logs"),
                 ["data.prefetch_steps=0"])  # fmt: skip
    named = [
        i
        for i in naive["incidents"]
        if i["node"] == "node-1" and i["diagnosis"] == "storage"
        and i["cause"] == "storage on node node-1"
    ]  # fmt: skip
    assert named, json.dumps(naive["incidents"], indent=1)
    assert named[0]["evidence"]["read_p99_s"] >= 2 * LATENCY_S  # a request and its answer

    for n in harness.nodes[:2]:
        _clear(n.cache_dir)
        assert harness.stage(n, url)["verified"] is True
    os.makedirs(tmp_path / "fixed-logs")
    fixed = _run(harness, url, str(tmp_path / "fixed"), str(tmp_path / "fixed-logs"), [])
    # A noisy 2-core machine may still show a compute straggler; storage must not appear.
    named = [i for i in fixed["incidents"] if "storage" in json.dumps(i)]
    assert named == [], json.dumps(fixed["incidents"], indent=1)
