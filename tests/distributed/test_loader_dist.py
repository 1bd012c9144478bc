"""Real multi-process runs over gloo: ranks together read exactly the single-process batches."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader
from steadytrain.testing import forkserver  # each rank forked: torch imported once

pytestmark = pytest.mark.dist
RANK_MAIN = os.path.join(os.path.dirname(__file__), "loader", "rank_main.py")


def make_dataset(root: str, shards: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    with DatasetWriter(
        root, vocab_size=4000, eos_id=0, tokenizer={"type": "test"}, shard_tokens=200
    ) as w:
        for _ in range(shards * 4):
            doc = rng.integers(1, 4000, size=int(rng.integers(20, 80)))
            doc[-1] = 0
            w.add_document(doc)
    return root


def launch(tmp_path, world: int, datasets: list[str], steps: int, **opts) -> list[dict]:
    out = tmp_path / f"out-{world}.json"
    init = tmp_path / f"init-{world}"
    extra = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        extra += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    argv = ["--datasets", *datasets, "--world", str(world), "--init", str(init)]
    argv += ["--steps", str(steps), "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, RANK_MAIN, *argv]
    procs = [forkserver.popen([*cmd, "--rank", str(r)], env=env) for r in range(world)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes}:\n" + "\n".join(outs)
    return json.loads(out.read_text())


def reference(datasets: list[str], steps: int, **kw) -> list[dict]:
    ds = [TokenDataset.open(u) for u in datasets]
    ld = TokenLoader(ds if len(ds) > 1 else ds[0], 16, 8, 8, seed=11, **kw)
    out = []
    for _ in range(steps):
        b = next(ld)
        out.append({"ids": b["sample_ids"].tolist(), "inputs": b["input_ids"].tolist()})
    ld.close()
    return out


@pytest.mark.timeout(180)
def test_four_ranks_read_the_global_batches_and_resume(tmp_path):
    data = [make_dataset(str(tmp_path / "a"), 3, 0)]
    want = reference(data, 30)  # several epochs of this small dataset
    got = launch(tmp_path, 4, data, 30, restart_at=9)
    assert got == want


@pytest.mark.timeout(180)
def test_two_ranks_blend_and_block_mode(tmp_path):
    data = [make_dataset(str(tmp_path / "a"), 3, 0), make_dataset(str(tmp_path / "b"), 2, 1)]
    want = reference(
        data,
        20,
        shuffle="block",
        weights=[2, 1],
        shuffle_settings={"block_size": 4, "window_blocks": 3},
    )
    got = launch(tmp_path, 2, data, 20, shuffle="block", weights=[2, 1], restart_at=4)
    assert got == want
