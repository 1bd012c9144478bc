"""Each diagnosis reproduced in a real training loop: a tiny torch model on random data, a
real GoodputMeter, and a real fault injected mid-run (slow storage reads with cache
evictions, a stalled loader, a loader whose memory grows with steps, a slowed compute step,
a slow synchronous torch.save checkpoint). Times are measured around next(), the step and
the save exactly as a user's loop would."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from steadytrain.errors import ConfigError
from steadytrain.monitor.alerts import AlertConfig, AlertEngine
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter

FAULT_AT = 16  # first faulty step; steps 4..13 form the baseline
STEPS = 36
CFG = AlertConfig(
    window=6,
    warmup=3,
    baseline=10,
    band_tolerance=0.5,
    memory_window=20,
    memory_growth_bytes=24 << 20,
    max_recovery_age_s=None,
)
BATCH, DIM = 16, 64


class RandomSource:
    """Random batches; optionally stalls (sleep inside next()) from FAULT_AT on."""

    def __init__(self, stall_s: float = 0.0) -> None:
        self.stall_s = stall_s
        self.n = 0

    def __next__(self):
        self.n += 1
        if self.stall_s and self.n >= FAULT_AT:
            time.sleep(self.stall_s)
        return torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)

    def metrics(self) -> dict:
        return {}


class ShardStore:
    """Batches read from real shard files through an in-memory shard cache. From FAULT_AT
    on the cache is evicted (a tiered file system moving shards out) and each read pays an
    injected 30 ms delay (recall from slow storage). Reports per-step cache misses and the
    p99 of read latency, as the loader does."""

    def __init__(self, root, evict: bool) -> None:
        self.paths = []
        for i in range(3):  # all three are cached during warm-up
            p = os.path.join(root, f"shard-{i}.npy")
            np.save(p, np.random.default_rng(i).standard_normal((BATCH * 8, DIM * 2), "float32"))
            self.paths.append(p)
        self.cache: dict[int, np.ndarray] = {}
        self.lat: list[float] = []  # this step's reads
        self.evict = evict
        self.n = 0
        self.misses = 0

    def _read(self, i: int) -> np.ndarray:
        t0 = time.perf_counter()
        if self.evict and self.n >= FAULT_AT:
            self.cache.clear()
        arr = self.cache.get(i)
        if arr is None:
            self.misses += 1
            if self.evict and self.n >= FAULT_AT:
                time.sleep(0.03)
            arr = self.cache[i] = np.load(self.paths[i])
        self.lat.append(time.perf_counter() - t0)
        return arr

    def __next__(self):
        self.n += 1
        arr = self._read(self.n % len(self.paths))
        j = (self.n * BATCH) % (arr.shape[0] - BATCH)
        x = torch.from_numpy(arr[j : j + BATCH].copy())
        return x[:, :DIM], x[:, DIM:]

    def metrics(self) -> dict:
        m, self.misses = self.misses, 0
        p99 = float(np.percentile(self.lat, 99))
        self.lat = []
        return {"cache_misses": m, "read_p99_s": p99}


class GrowingIndexSource(RandomSource):
    """From FAULT_AT on, every next() appends 4 MiB to an index that is never freed; once
    it is large, lookups get slower as it grows (the incident: memory grew first, then the
    loader fell behind)."""

    def __init__(self) -> None:
        super().__init__()
        self.index: list[np.ndarray] = []

    def __next__(self):
        if self.n + 1 >= FAULT_AT:
            self.index.append(np.ones(1 << 19))  # 4 MiB, touched: real RSS growth
            time.sleep(0.01 * max(0, len(self.index) - 6))
        return super().__next__()


def run_loop(run_dir, source, **kw):
    # One intra-op thread: on a shared 2-core machine OpenMP spin-waits make a tiny
    # model's step jitter by 60 ms, which would drown the injected faults.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _loop(run_dir, source, **kw)
    finally:
        torch.set_num_threads(threads)


def _loop(run_dir, source, slow_compute_s=0.0, ckpt_every=0, ckpt_dir=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, DIM)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = torch.randn(16 << 20) if ckpt_every else None  # 64 MiB of "optimizer state"
    meter = GoodputMeter(run_dir, sinks=("jsonl",), alert_config=CFG)
    meter.job_start()
    for step in range(1, STEPS + 1):
        t0 = time.perf_counter()
        x, y = next(source)
        t1 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.008)  # the accelerator's share of the step
        if slow_compute_s and step >= FAULT_AT:
            time.sleep(slow_compute_s)  # a throttled device: the step itself is slower
        t2 = time.perf_counter()
        block = 0.0
        if ckpt_every and step >= FAULT_AT and step % ckpt_every == 0:
            path = os.path.join(ckpt_dir, f"step-{step}.pt")
            torch.save({"model": model.state_dict(), "state": big}, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            block = time.perf_counter() - t2
            meter.event(
                {
                    "type": "checkpoint",
                    "step": step,
                    "block_s": block,
                    "durable_s": block,
                    "ok": True,
                    "path": path,
                    "error": None,
                }
            )
        meter.step(
            step,
            tokens=BATCH * DIM,
            data_wait_s=t1 - t0,
            compute_s=t2 - t1,
            checkpoint_block_s=block,
            loss=loss.detach(),
            **source.metrics(),
        )
    meter.close()
    alerts = [r for r in read_ledger(run_dir) if r["type"] == "alert"]
    # Every alert is about the injected fault, none about start-up noise.
    assert all(a["step"] >= FAULT_AT for a in alerts), alerts
    return {a["kind"]: a for a in alerts}, meter


def test_slow_storage_is_diagnosed_as_storage(tmp_path):
    alerts, _ = run_loop(tmp_path / "run", ShardStore(tmp_path, evict=True))
    assert alerts["throughput_band"]["diagnosis"] == "storage"
    assert alerts["data_wait_share"]["diagnosis"] == "storage"
    assert alerts["read_latency"]["diagnosis"] == "storage"
    assert alerts["throughput_band"]["step"] >= FAULT_AT
    assert "cache" in alerts["throughput_band"]["next"]


def test_stalled_loader_without_storage_signals_is_data_loading(tmp_path):
    alerts, _ = run_loop(tmp_path, RandomSource(stall_s=0.03))
    assert alerts["throughput_band"]["diagnosis"] == "data loading"
    assert alerts["data_wait_share"]["diagnosis"] == "data loading"
    assert "memory_growth" not in alerts and "read_latency" not in alerts


def test_growing_loader_memory_is_diagnosed(tmp_path):
    src = GrowingIndexSource()
    alerts, _ = run_loop(tmp_path, src)
    mem = alerts["memory_growth"]
    assert mem["diagnosis"] == "data-loader memory"
    # 4 MiB/step is appended; the slope window may straddle the start of the growth.
    assert mem["evidence"]["rss_bytes"]["bytes_per_step"] > 1 << 20
    # The data wait that grows with the index is attributed to the memory growth too.
    assert alerts["throughput_band"]["diagnosis"] == "data-loader memory"
    recs = [r for r in read_ledger(tmp_path) if r["type"] == "step"]
    assert recs[-1]["rss_bytes"] - recs[FAULT_AT - 2]["rss_bytes"] > 48 << 20


def test_slow_compute_is_diagnosed_as_compute(tmp_path):
    alerts, _ = run_loop(tmp_path, RandomSource(), slow_compute_s=0.03)
    assert alerts["throughput_band"]["diagnosis"] == "compute/hardware"
    assert alerts["throughput_band"]["evidence"]["compute_ratio"] > 1.3
    assert "data_wait_share" not in alerts


def test_slow_sync_checkpoint_is_diagnosed_as_checkpointing(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    alerts, meter = run_loop(tmp_path / "run", RandomSource(), ckpt_every=2, ckpt_dir=ck)
    assert alerts["throughput_band"]["diagnosis"] == "checkpointing"
    assert alerts["checkpoint_blocking"]["diagnosis"] == "checkpointing"
    b = meter.breakdown()
    assert b.badput_s["checkpoint_block"] > 0.1


def test_recovery_point_age_and_failed_checkpoint_alerts():
    eng = AlertEngine(AlertConfig(max_recovery_age_s=60.0, window=3, baseline=3, warmup=0))
    assert eng.observe({"type": "job_start", "t": 0.0}) == []
    rec = {
        "type": "step",
        "t": 30.0,
        "step": 1,
        "tokens": 1,
        "step_s": 1.0,
        "data_wait_s": 0.0,
        "compute_s": 1.0,
        "checkpoint_block_s": 0.0,
    }
    assert eng.observe(rec) == []
    eng.observe({"type": "checkpoint", "t": 40.0, "step": 1, "ok": True})
    late = eng.observe(dict(rec, t=101.0, step=2))
    assert [a["kind"] for a in late] == ["recovery_point_age"]
    assert late[0]["diagnosis"] == "checkpointing"
    failed = eng.observe(
        {
            "type": "checkpoint",
            "t": 102.0,
            "step": 2,
            "ok": False,
            "error": "No space left on device",
            "path": "c/2",
        }
    )
    assert failed[0]["kind"] == "checkpoint_failed" and "No space" in failed[0]["message"]


def test_bad_config_is_refused_at_construction():
    with pytest.raises(ConfigError, match="window"):
        AlertConfig(window=1)
    with pytest.raises(ConfigError, match="low bound"):
        AlertEngine(expected_tokens_per_s=(14_000, 13_500))


def test_explicit_band_fires_without_baseline():
    eng = AlertEngine(
        AlertConfig(window=3, baseline=50, warmup=0),
        expected_tokens_per_s=(13_500, 14_000),
        world_size=2,
    )
    eng.observe({"type": "job_start", "t": 0.0})
    out = []
    for s in range(1, 11):  # 2 ranks at 10k tokens/s each: below the per-GPU band
        out += eng.observe(
            {
                "type": "step",
                "t": float(s),
                "step": s,
                "tokens": 20_000,
                "step_s": 1.0,
                "data_wait_s": 0.5,
                "compute_s": 0.5,
                "checkpoint_block_s": 0.0,
            }
        )
    band = [a for a in out if a["kind"] == "throughput_band"]
    assert len(band) == 1 and band[0]["diagnosis"] == "data loading"
    assert band[0]["evidence"]["tokens_per_s_per_gpu"] == pytest.approx(10_000)
