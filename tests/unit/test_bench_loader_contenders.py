"""The loader benchmark's contenders hand the trainer the same thing as ours, and its summary
takes ratios from medians.

A faster peer that returned the wrong windows, or labels not shifted by one, would make the
comparison meaningless; so would a summary that picked a best-of round.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

from steadytrain.data.ingest.writer import DatasetWriter

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def _load(name: str, path: str):
    sys.path.insert(0, BENCH)  # the bench scripts import _loader_common from beside them
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(BENCH)


@pytest.fixture(scope="module")
def peers():
    return _load("bench_loader_peers", os.path.join(BENCH, "peers", "loader_peers.py"))


@pytest.fixture(scope="module")
def throughput():
    return _load("bench_loader_throughput", os.path.join(BENCH, "loader_throughput.py"))


def _dataset(root: str) -> np.ndarray:
    toks = np.arange(3 * 1000, dtype=np.uint16)  # distinct ids: a wrong window shows
    with DatasetWriter(
        root, vocab_size=50257, eos_id=50256, tokenizer={"type": "t"}, shard_tokens=1000
    ) as w:
        w.add_documents(toks, np.array([1000, 1000, 1000]))
    return toks


def test_batched_fetch_returns_the_per_sample_windows_as_int64(tmp_path, peers):
    _dataset(str(tmp_path / "ds"))
    seq = 16
    per_sample = peers.MegatronStyleMap(str(tmp_path / "ds"), seq)
    batched = peers.BatchedMap(str(tmp_path / "ds"), seq)
    idx = [0, 61, 62, 123, 5]  # samples from all three shards, the last of a shard included
    got = batched[idx]
    assert got["input_ids"].dtype == torch.int64 and got["labels"].dtype == torch.int64
    assert got["input_ids"].is_contiguous() and got["labels"].is_contiguous()
    for row, i in enumerate(idx):
        want = per_sample[i]
        assert torch.equal(got["input_ids"][row], want["input_ids"])
        assert torch.equal(got["labels"][row], want["labels"])
    assert torch.equal(got["labels"][:, :-1], got["input_ids"][:, 1:])


def test_raw_windows_become_contiguous_int64_inputs_and_labels(peers):
    raw = torch.arange(2 * 9, dtype=torch.int32).reshape(2, 9)
    inp, lab = peers.to_model_inputs(raw)
    assert inp.dtype == lab.dtype == torch.int64
    assert inp.is_contiguous() and lab.is_contiguous()
    assert torch.equal(inp, raw[:, :-1].long()) and torch.equal(lab, raw[:, 1:].long())


def test_rows_report_min_median_max_and_ratios_use_medians(throughput):
    def run(cpu: float) -> dict:
        return {"m_tokens_per_s": cpu, "m_tokens_per_cpu_s": cpu, "cpu_ns_per_token": 1e3 / cpu}

    runs = {
        throughput.FLOOR_INT64: [run(100), run(90), run(200)],
        throughput.INPROC: [run(80), run(10), run(70)],
        "torchdata (batched fetch) workers=0": [run(40), run(35), run(300)],
        "litdata workers=0": [run(30), {"error": "exit 1"}, run(30)],
    }
    rows = throughput.spread_rows(runs)
    assert rows[throughput.INPROC]["m_tokens_per_cpu_s"] == {"min": 10, "median": 70, "max": 80}
    assert rows["litdata workers=0"]["runs"] == 2 and rows["litdata workers=0"]["errors"] == 1
    summary = throughput.summarise(rows)
    assert summary["fastest_peer_per_cpu"] == "torchdata (batched fetch) workers=0"
    assert summary["ours_inproc_vs_fastest_peer_per_cpu"] == pytest.approx(70 / 40)
    assert summary["ours_inproc_vs_int64_floor_per_cpu"] == pytest.approx(70 / 100)
