"""The cache benchmark's read-ahead baseline reads exactly the windows ours hands each rank,
and its summary charges a step with its slowest rank's data wait.

A baseline that fetched fewer or other bytes than the loader would make its data wait and
its remote bytes meaningless; a summary that averaged the ranks would hide the rank the
barrier waits for.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def _load(name: str, path: str):
    sys.path.insert(0, BENCH)  # the bench scripts import their helpers from beside them
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def ranks():
    return _load("bench_cache_ranks", os.path.join(BENCH, "_cache_ranks.py"))


@pytest.fixture(scope="module")
def coordinator():
    return _load("bench_cache_peers", os.path.join(BENCH, "cache_peers.py"))


def test_readahead_reads_the_windows_the_loader_hands_each_rank(tmp_path, ranks):
    root = str(tmp_path / "ds")
    toks = np.arange(3 * 1000, dtype=np.uint16)  # distinct ids: a wrong window shows
    with DatasetWriter(
        root, vocab_size=50257, eos_id=50256, tokenizer={"type": "t"}, shard_tokens=1000
    ) as w:
        w.add_documents(toks, np.array([1000, 1000, 1000]))
    seq, per_rank, world = 16, 4, 2
    steps = 2 * (3 * ((1000 - 1) // seq)) // (per_rank * world) + 2  # across 2 epoch ends
    a = argparse.Namespace(url=root, seq=seq, per_rank=per_rank, steps=steps, ahead=3)
    for rank in range(world):
        base = ranks.ReadAhead(a, rank, world)
        loader = TokenLoader(
            TokenDataset.open(root),
            seq_len=seq,
            global_batch=per_rank * world,
            micro_batch=per_rank,
            rank=rank,
            world_size=world,
            shuffle="sequential",
            labels="next",
            prefetch=0,
        )
        for _ in range(steps):
            inputs, labels = base()
            want = next(loader)
            assert np.array_equal(inputs.numpy(), want["input_ids"].numpy())
            assert np.array_equal(labels.numpy(), want["labels"].numpy())
        loader.close()
        base.pool.shutdown()
    # 186 samples an epoch, 8 a step: step 24 is the first to start in epoch 2 (at 192),
    # step 47 the first in epoch 3 (at 376 >= 372).
    assert base.epoch_starts == [0, 24, 47]


def test_summary_charges_each_step_its_slowest_rank(coordinator):
    a = argparse.Namespace(warmup_steps=1, fill_step=2, steps_per_shard=1)
    walls = [1.0, 1.0, 1.0, 1.0]
    ranks = [
        {
            "waits": [0.5, 0.1, 0.0, 0.2],
            "walls": walls,
            "epoch_starts": [0, 3],
            "samples": 8,
            "build_s": 1,
        },
        {
            "waits": [0.0, 0.0, 0.3, 0.0],
            "walls": walls,
            "epoch_starts": [0, 3],
            "samples": 8,
            "build_s": 2,
        },
    ]
    out = coordinator.summarise(a, ranks)
    assert out["cold_start_wait_s"] == pytest.approx(0.5)
    assert out["data_wait_share"] == pytest.approx((0.1 + 0.3 + 0.2) / 3)
    assert out["after_fill_wait_share"] == pytest.approx(0.3)  # step 2, before epoch 2
    assert out["epoch2_wait_share"] == pytest.approx(0.2)
    assert out["samples"] == 16
