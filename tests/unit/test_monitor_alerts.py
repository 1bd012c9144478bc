"""Each diagnosis reproduced from a synthetic run fed through a real GoodputMeter: a baseline
with jitter, slow warm-up steps and one GC pause, then a fault from ``FAULT_AT`` on (slow
storage reads with cache evictions, a stalled loader, a loader whose memory grows with
steps, a slowed compute step, a slow synchronous checkpoint). The per-step durations are
given, not slept (``steadytrain.testing.synthetic``), so the verdicts do not depend on the
machine's speed or load; the records take the meter's real path to the ledger, the goodput
accumulator and the alert engine."""

from __future__ import annotations

import numpy as np
import pytest

from steadytrain.errors import ConfigError
from steadytrain.monitor.alerts import AlertConfig, AlertEngine
from steadytrain.monitor.ledger import read_ledger
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.testing.synthetic import Timeline, feed

FAULT_AT = 16  # first faulty step; steps 4..13 form the baseline
STEPS = 36
GC_PAUSE_AT = 14  # one slow step between baseline and fault: never an alert by itself
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
MiB = 1 << 20
# What a tiny model's step costs on a CPU (seconds), before jitter.
DATA_S, COMPUTE_S, OTHER_S = 0.0004, 0.012, 0.0006
STALL_S = 0.03  # an injected delay: a stalled loader, a recall from slow storage
SAVE_S = 0.15  # a synchronous 64 MiB torch.save with fsync


def simulate(fault: str | None) -> Timeline:
    """STEPS steps of one attempt; ``fault`` in storage / stall / memory / compute /
    checkpoint changes what the steps from FAULT_AT on cost (and what the loader reports)."""
    rng = np.random.default_rng(0)

    def jitter(x: float) -> float:
        return x * float(rng.uniform(0.85, 1.15))

    tl = Timeline()
    tl.job_start(startup_s=0.5)
    rss = 600 * MiB
    for step in range(1, STEPS + 1):
        warm = step <= CFG.warmup  # compile, allocator and cache warm-up
        n = step - FAULT_AT + 1  # faulty steps so far (<= 0 before the fault)
        data, compute, other = jitter(DATA_S), jitter(COMPUTE_S) * (3 if warm else 1), OTHER_S
        if step == GC_PAUSE_AT:
            other += 5 * COMPUTE_S
        block, saved = 0.0, False
        extra: dict = {}
        if fault == "storage":  # the shard cache: hits after warm-up, until the eviction
            miss = warm or n > 0
            extra["cache_misses"] = int(miss)
            extra["read_p99_s"] = jitter(0.001 if warm else 2e-6)
            if n > 0:  # evicted: every read is recalled from slow storage
                data += STALL_S
                extra["read_p99_s"] = jitter(0.001) + STALL_S
        elif fault == "stall" and n > 0:
            data += STALL_S
        elif fault == "memory" and n > 0:
            rss += 4 * MiB  # an index appended to on every next(), never freed
            data += 0.01 * max(0, n - 6)  # once it is large, lookups slow down with it
        elif fault == "compute" and n > 0:
            compute += STALL_S  # a throttled device: the step itself is slower
        elif fault == "checkpoint" and n > 0 and step % 2 == 0:
            block, saved = jitter(SAVE_S), True
        elif fault == "eval" and n > 0 and step % 2 == 0:
            extra["eval_s"] = jitter(SAVE_S)  # an evaluation before every 2nd step
        tl.step(
            step,
            tokens=BATCH * DIM,
            data_wait_s=data,
            compute_s=compute,
            checkpoint_block_s=block,
            other_s=other,
            saved=saved,
            loss=1.0 / step,
            rss_bytes=rss + int(rng.integers(-4, 5)) * 16384,  # allocator noise
            shm_bytes=0,
            **extra,
        )
    return tl


def run(run_dir, fault: str | None):
    """Feed the synthetic run through a real meter; return its alerts by kind, the meter
    (closed) and the timeline."""
    tl = simulate(fault)
    meter = GoodputMeter(run_dir, sinks=("jsonl",), alert_config=CFG)
    feed(meter, tl.anchored())
    meter.close()
    alerts = [r for r in read_ledger(run_dir) if r["type"] == "alert"]
    # Every alert is about the injected fault, none about warm-up or the GC pause.
    assert all(a["step"] >= FAULT_AT for a in alerts), alerts
    return {a["kind"]: a for a in alerts}, meter, tl


def test_a_healthy_run_raises_no_alert(tmp_path):
    alerts, _, _ = run(tmp_path, None)
    assert alerts == {}


def test_evaluations_between_steps_are_no_throughput_drop(tmp_path):
    """Issue 42: an evaluation (``eval_s``, its own bucket) is no part of the loop's
    throughput: evaluations 12x a step long before every 2nd step raise no alert."""
    alerts, meter, _ = run(tmp_path, "eval")
    assert alerts == {}
    assert meter.breakdown().badput_s["eval"] > 10 * SAVE_S


def test_slow_storage_is_diagnosed_as_storage(tmp_path):
    alerts, _, _ = run(tmp_path, "storage")
    assert alerts["throughput_band"]["diagnosis"] == "storage"
    assert alerts["data_wait_share"]["diagnosis"] == "storage"
    assert alerts["read_latency"]["diagnosis"] == "storage"
    assert alerts["throughput_band"]["step"] >= FAULT_AT
    assert "cache" in alerts["throughput_band"]["next"]


def test_stalled_loader_without_storage_signals_is_data_loading(tmp_path):
    alerts, _, _ = run(tmp_path, "stall")
    assert alerts["throughput_band"]["diagnosis"] == "data loading"
    assert alerts["data_wait_share"]["diagnosis"] == "data loading"
    assert "memory_growth" not in alerts and "read_latency" not in alerts


def test_growing_loader_memory_is_diagnosed(tmp_path):
    alerts, _, _ = run(tmp_path, "memory")
    mem = alerts["memory_growth"]
    assert mem["diagnosis"] == "data-loader memory"
    # 4 MiB/step is appended; the slope window may straddle the start of the growth.
    assert mem["evidence"]["rss_bytes"]["bytes_per_step"] > 1 * MiB
    # The data wait that grows with the index is attributed to the memory growth too.
    assert alerts["throughput_band"]["diagnosis"] == "data-loader memory"


def test_slow_compute_is_diagnosed_as_compute(tmp_path):
    alerts, _, _ = run(tmp_path, "compute")
    assert alerts["throughput_band"]["diagnosis"] == "compute/hardware"
    assert alerts["throughput_band"]["evidence"]["compute_ratio"] > 1.3
    assert "data_wait_share" not in alerts


def test_slow_sync_checkpoint_is_diagnosed_as_checkpointing(tmp_path):
    alerts, meter, tl = run(tmp_path, "checkpoint")
    assert alerts["throughput_band"]["diagnosis"] == "checkpointing"
    assert alerts["checkpoint_blocking"]["diagnosis"] == "checkpointing"
    # Every blocked second reaches the checkpoint_block bucket, and only those.
    blocked = sum(r["checkpoint_block_s"] for r in tl.records if r["type"] == "step")
    assert blocked > 1.0
    assert meter.breakdown().badput_s["checkpoint_block"] == pytest.approx(blocked)


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


def test_a_share_is_never_above_100_percent(tmp_path):
    """A caller whose data_wait_s exceeds the wall time between its step() calls (figures
    from another clock, or simply wrong) gets an alert that stays within its meaning."""
    import re

    meter = GoodputMeter(tmp_path, sinks=("jsonl",), alert_config=CFG)
    meter.job_start(restored_step=0)
    for step in range(1, STEPS + 1):
        meter.step(step, tokens=BATCH * DIM, data_wait_s=5.0, compute_s=0.01)
    meter.close()
    alerts = [r for r in read_ledger(tmp_path) if r.get("kind") == "data_wait_share"]
    assert alerts, "a data wait that dominates every step must raise the alert"
    shares = [int(x) for a in alerts for x in re.findall(r"data wait is (\d+)%", a["message"])]
    assert shares and max(shares) <= 100, shares
