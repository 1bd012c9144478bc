"""Straggler diagnosis (monitor/straggler.py) on rank files written by the real writer.

Each scenario writes four ranks on two nodes through ``RankFile`` (the meter's own writer),
then checks both the post-hoc analysis (``analyze`` over ``read_ranks``) and the live check
(``StragglerCheck`` tailing the same files).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.ranks import RankFile, read_ranks
from steadytrain.monitor.straggler import analyze
from steadytrain.monitor.straggler_live import StragglerCheck

MiB = 1 << 20
NODES = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
STEPS, FAULT_FROM = 60, 30

Tweak = Callable[[int, int, dict[str, Any]], None]  # (rank, step, record) -> edits in place


def _records(rank: int, tweak: Tweak | None, device: str = "cpu") -> list[dict[str, Any]]:
    rng = random.Random(rank)
    out: list[dict[str, Any]] = [
        {
            "type": "rank_start",
            "attempt": 0,
            "rank": rank,
            "node": NODES[rank],
            "world_size": 4,
            "device": device,
            "t": 1000.0 + 3600 * (rank % 2),  # clocks an hour apart: alignment is by step
        }
    ]
    for step in range(1, STEPS + 1):
        rec = {
            "type": "rank_step",
            "step": step,
            "attempt": 0,
            "t": 1000.0 + 3600 * (rank % 2) + 0.1 * step,
            "step_s": 0.1 + rng.uniform(-0.005, 0.005),
            "data_wait_s": 0.002 + rng.uniform(0, 0.001),
            "forward_s": 0.03 + rng.uniform(-0.002, 0.002),
            "compute_s": 0.098,
            "read_p99_s": 0.001 + rng.uniform(0, 0.0002),
            "cache_hits": 2,
            "cache_misses": 0,
            "rss_bytes": 500 * MiB + rng.randrange(0, MiB),
            "shm_bytes": 10 * MiB,
        }
        if tweak is not None and step >= FAULT_FROM:
            tweak(rank, step, rec)
        out.append(rec)
    return out


def _write(run_dir: Path, tweak: Tweak | None, device: str = "cpu") -> None:
    for rank in NODES:
        f = RankFile(run_dir, rank, snapshot_every=25)
        recs = _records(rank, tweak, device)
        for i in range(0, len(recs), 7):  # several batches, as the background thread writes
            f.write(recs[i : i + 7])
        f.close()


def _post_hoc(run_dir: Path) -> list[dict[str, Any]]:
    return analyze(read_ranks(run_dir), AlertConfig())


def _live(run_dir: Path, tweak: Tweak | None, device: str = "cpu") -> list[dict[str, Any]]:
    check = StragglerCheck(run_dir, AlertConfig())
    check.check()  # first sight: the tail starts at each file's end
    _write(run_dir, tweak, device)
    return check.check()


def _slow_storage(ranks: set[int]) -> Tweak:
    def tweak(rank: int, step: int, rec: dict[str, Any]) -> None:
        rec["step_s"] = 0.19  # every rank's step: the others wait in the all-reduce
        if rank in ranks:
            rec["data_wait_s"] = 0.09
            rec["read_p99_s"] = 0.06
            rec["cache_misses"] = 2

    return tweak


def test_storage_straggler_names_rank_node_and_cause(tmp_path: Path) -> None:
    _write(tmp_path, _slow_storage({3}))
    [a] = _post_hoc(tmp_path)
    assert (a["kind"], a["rank"], a["node"], a["diagnosis"]) == (
        "straggler",
        3,
        "node-b",
        "storage",
    )
    assert a["cause"] == "storage on node node-b"
    ev = a["evidence"]
    assert ev["data_wait_s_per_step"] > 0.05 and ev["others_data_wait_s_per_step"] < 0.01
    assert ev["read_p99_s"] >= 0.06 and ev["others_read_p99_s"] < 0.002
    assert FAULT_FROM - 20 <= a["step"] <= FAULT_FROM and a["last_step"] == STEPS
    assert "nvidia-smi" not in a["next"]  # a CPU run: no GPU advice


def test_live_check_finds_the_same_straggler(tmp_path: Path) -> None:
    [a] = _live(tmp_path, _slow_storage({3}))
    assert (a["type"], a["rank"], a["node"], a["cause"]) == (
        "alert",
        3,
        "node-b",
        "storage on node node-b",
    )
    assert a["step"] == STEPS and a["t"] is not None


def test_every_rank_of_one_node_makes_one_node_alert(tmp_path: Path) -> None:
    _write(tmp_path, _slow_storage({2, 3}))
    [a] = _post_hoc(tmp_path)
    assert a["ranks"] == [2, 3] and a["rank"] is None and a["node"] == "node-b"
    assert a["cause"] == "storage on node node-b"


def test_memory_straggler(tmp_path: Path) -> None:
    def tweak(rank: int, step: int, rec: dict[str, Any]) -> None:
        rec["step_s"] = 0.17
        if rank == 2:
            rec["data_wait_s"] = 0.07
            rec["shm_bytes"] = 10 * MiB + (step - FAULT_FROM) * 8 * MiB  # /dev/shm fills up

    _write(tmp_path, tweak)
    [a] = _post_hoc(tmp_path)
    assert (a["rank"], a["diagnosis"], a["cause"]) == (
        2,
        "data-loader memory",
        "loader memory on rank 2",
    )
    assert a["evidence"]["memory_growth_bytes"] >= 64 * MiB


def test_data_loading_straggler_when_storage_and_memory_are_flat(tmp_path: Path) -> None:
    def tweak(rank: int, step: int, rec: dict[str, Any]) -> None:
        rec["step_s"] = 0.15
        if rank == 1:
            rec["data_wait_s"] = 0.05

    _write(tmp_path, tweak)
    [a] = _post_hoc(tmp_path)
    assert (a["rank"], a["node"], a["cause"]) == (1, "node-a", "data loading on rank 1")


def test_compute_straggler_on_gpu_gets_gpu_advice(tmp_path: Path) -> None:
    def tweak(rank: int, step: int, rec: dict[str, Any]) -> None:
        rec["step_s"] = 0.2  # the others wait for rank 0 inside the all-reduce
        if rank == 0:
            rec["forward_s"] = 0.07

    _write(tmp_path, tweak, device="cuda")
    [a] = _post_hoc(tmp_path)
    assert (a["rank"], a["node"], a["diagnosis"], a["cause"]) == (
        0,
        "node-a",
        "compute/hardware",
        "compute on rank 0",
    )
    assert a["evidence"]["forward_ratio"] > 2
    assert "nvidia-smi" in a["next"]


def test_uniform_slowdown_names_a_shared_cause(tmp_path: Path) -> None:
    def tweak(rank: int, step: int, rec: dict[str, Any]) -> None:
        rec["step_s"] = 0.2
        rec["data_wait_s"] = 0.1
        rec["read_p99_s"] = 0.05

    _write(tmp_path, tweak)
    [a] = _post_hoc(tmp_path)
    assert a["kind"] == "shared_slowdown" and a["ranks"] == [0, 1, 2, 3]
    assert a["rank"] is None and a["diagnosis"] == "storage"
    assert a["cause"] == "storage shared by every node"
    assert a["evidence"]["step_s_rise_min"] > 0.5
    [live] = _live(tmp_path / "live", tweak)
    assert live["cause"] == "storage shared by every node"


@pytest.mark.parametrize("check", ["post-hoc", "live"])
def test_healthy_run_raises_nothing(tmp_path: Path, check: str) -> None:
    if check == "live":
        assert _live(tmp_path, None) == []
    else:
        _write(tmp_path, None)
        assert _post_hoc(tmp_path) == []


def test_live_check_fires_once_per_incident(tmp_path: Path) -> None:
    check = StragglerCheck(tmp_path, AlertConfig())
    check.check()
    _write(tmp_path, _slow_storage({3}))
    assert len(check.check()) == 1
    assert check.check() == []  # still the same incident: no new alert


def test_slow_reads_with_a_growing_loader_and_no_misses_are_loader_memory() -> None:
    """The loader-memory replay under a loaded host: the naive loader's reads were 4x the
    other rank's p99 with no cache misses on either, while its memory grew 320 MB against
    160 MB. Slow reads alone are not storage's signature when the loader's own memory
    explains them; cache misses still are."""
    from steadytrain.monitor.alerts import AlertConfig
    from steadytrain.monitor.straggler import Window, _data_cause

    MB = 1 << 20

    def w(p99: float, misses: float, grow: float) -> Window:
        return Window(n=10, step_s=1.5, data_wait_s=1.2, cache_misses=misses, read_p99_s=p99,
                      mem_first=1000 * MB, mem_last=1000 * MB + grow)  # fmt: skip

    cfg = AlertConfig()
    naive = {1: w(0.006, 0.0, 320 * MB), 0: w(0.00145, 0.0, 160 * MB)}
    assert _data_cause(1, naive, None, cfg)[0] == "data-loader memory"
    evicted = {1: w(0.006, 10.0, 320 * MB), 0: w(0.00145, 0.0, 160 * MB)}
    assert _data_cause(1, evicted, None, cfg)[0] == "storage"  # misses: storage still
    slow_store = {1: w(0.006, 0.0, 0.0), 0: w(0.00145, 0.0, 0.0)}
    assert _data_cause(1, slow_store, None, cfg)[0] == "storage"  # flat memory: storage
