"""Helpers of bench/checkpoint_block.py: the collective timers and the cold-restore benchmark.

Restore from a cold page cache: ``Checkpointer.restore_latest`` (``verify='full'`` and
``'overlap'``) and plain ``dcp.load`` against reading the checkpoint's bytes with as many
readers as the restore has.
"""

from __future__ import annotations

import os
import statistics
import time


def max_over_ranks(dist, x: float) -> float:
    import torch

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(dist, fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return max_over_ranks(dist, time.perf_counter() - t0)


def _evict(directory: str, rank: int) -> None:
    """Drop the directory's pages from the page cache (fsync, then FADV_DONTNEED)."""
    import torch.distributed as dist

    if rank == 0:
        for n in os.listdir(directory):
            fd = os.open(os.path.join(directory, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    dist.barrier()


def bench_restore(ck_dir: str, step: int, states: dict, rank: int, reps: int) -> dict:
    """Restore vs reading the checkpoint's bytes, all from a cold page cache.

    Every repetition runs every method once, each after evicting the checkpoint's files
    (fsync + ``POSIX_FADV_DONTNEED``; the same for all methods, other workers' caches are left
    alone); the order rotates between repetitions so no method always runs first. Methods:
    - ``parallel_read``: the baseline, each rank reads the files its rank wrote in 16 MiB
      ``read()`` calls, both ranks at once: as many readers as the restore has, the I/O a
      2-rank restore cannot avoid,
    - ``sequential_read``: for reference, one reader (rank 0) reads every file front to back
      (the baseline of earlier tables, which compared a 2-rank restore with one reader),
    - ``restore_full`` / ``restore_overlap``: ``Checkpointer.restore_latest`` on both ranks,
    - ``dcp_load_unverified``: plain ``dcp.load`` with ``raw_records.ShardReader`` (DCP's
      ``FileSystemReader`` plus raw records, read as DCP reads its archives: into a fresh
      tensor, then copied; no checksums, no COMMIT, no JSON/RNG): what DCP alone costs,
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from steadytrain.checkpoint import Checkpointer
    from steadytrain.checkpoint.raw_records import ShardReader

    step_dir = os.path.join(ck_dir, f"step-{step:08d}")
    ckpts = {v: Checkpointer(ck_dir, async_mode="sync", verify=v) for v in ("full", "overlap")}

    def read_all() -> None:
        if rank == 0:
            for n in sorted(os.listdir(step_dir)):
                with open(os.path.join(step_dir, n), "rb", buffering=0) as f:
                    while f.read(16 << 20):
                        pass

    from steadytrain.checkpoint.writer import rank_files

    own = rank_files(step_dir, rank)

    def read_own() -> None:
        for n in own:
            with open(os.path.join(step_dir, n), "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass

    def restore(verify: str) -> None:
        assert ckpts[verify].restore_latest(states) == step

    methods = {
        "sequential_read": read_all,
        "parallel_read": read_own,
        "restore_full": lambda: restore("full"),
        "restore_overlap": lambda: restore("overlap"),
        "dcp_load_unverified": lambda: dcp.load(
            {"blob": states["blob"].state_dict()}, storage_reader=ShardReader(step_dir)
        ),
    }
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            _evict(step_dir, rank)
            times[name].append(timed(dist, methods[name]))
    out: dict = {"reps": reps, "order": "rotating, interleaved", "cold": "fsync+FADV_DONTNEED"}
    for name in names:
        out[f"{name}_s"] = statistics.median(times[name])
        out[f"{name}_all_s"] = times[name]
    out["checkpoint_bytes"] = sum(
        os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir)
    )
    seq = out["sequential_read_s"]
    out["sequential_read_gb_s"] = out["checkpoint_bytes"] / seq / 1e9
    par = out["parallel_read_s"]
    for name in ("restore_full", "restore_overlap", "dcp_load_unverified"):
        out[f"ratio_{name.removeprefix('restore_')}"] = out[f"{name}_s"] / seq
        out[f"ratio_{name.removeprefix('restore_')}_vs_parallel_read"] = out[f"{name}_s"] / par
    # per repetition, against the same repetition's 2-reader read (robust to drift)
    for name in ("restore_full", "restore_overlap", "dcp_load_unverified"):
        key = name.removeprefix("restore_")
        out[f"ratio_{key}_vs_parallel_read_per_rep"] = [
            f / b for f, b in zip(times[name], times["parallel_read"], strict=True)
        ]
        out[f"{name}_spread_s"] = {
            "min": min(times[name]), "median": statistics.median(times[name]),
            "max": max(times[name]),
        }  # fmt: skip
    out["parallel_read_spread_s"] = {
        "min": min(times["parallel_read"]),
        "median": statistics.median(times["parallel_read"]),
        "max": max(times["parallel_read"]),
    }
    return out
