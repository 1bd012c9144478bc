"""How long does a checkpoint block the training loop? 2 ranks on CPU, side by side.

    .venv/bin/python bench/checkpoint_block.py                 # 256 MiB and 1 GiB
    .venv/bin/python bench/checkpoint_block.py --sizes-mib 256 1024 4096
    .venv/bin/python bench/checkpoint_block.py --only restore --out /tmp/r.json  # restore only

Each rank holds half of the state (as FSDP would) in 16 tensors. Per size, in one run:
- ``torch.save`` on rank 0 after gathering the shards (the common first attempt),
- DCP ``save`` (sync, ``FileSystemWriter`` defaults), and the same with torch's zip CRC-32
  off (``torch.serialization.set_crc32_options(False)``; for reference: what the CRC costs
  DCP), DCP ``async_save`` with the thread and process executor,
  each with one persistent ``DefaultStager`` created once and reused for every save, as
  torch's docs recommend (``StagingOptions``: pinned memory, async staging and non-blocking
  copies where CUDA is available; shared memory for the process executor), and
  ``DefaultSavePlanner(enable_plan_caching=True)`` (DCP's plan reuse across saves),
- ours: ``Checkpointer`` in ``thread`` and ``process`` mode (staging into reused buffers),
- the memcpy reference: the copy our staging does (``np.copyto``) into buffers allocated
  and touched once and reused, both ranks at once (they share the memory bus, as in
  staging), run in the rotation like every contender and reported as a spread,
- restore: ``Checkpointer.restore_latest`` (``verify='full'`` and ``'overlap'``) and plain
  ``dcp.load`` vs both ranks reading their own files at once (as many readers as the
  restore; one reader reading everything is kept in the JSON for reference), all from a cold
  page cache (each run after fsync + ``posix_fadvise(DONTNEED)`` of the checkpoint's files),
  interleaved in rotating order, medians of ``--restore-reps`` (5).
Every repetition runs every save contender once, in an order that rotates by one place per
repetition, so none always runs first or after the same neighbour. Per contender: blocked
(time until control returns to the loop) and durable after (time from the call until the
checkpoint is durable: DCP's future resolved, ours COMMIT published and fsync'd), both the
max over ranks. Save 1 (buffer allocation, DCP's daemon start) is reported apart; saves
2..``--repeats`` give min / median / max, and every ratio is one of medians.
Writes JSON to bench/results/checkpoint_block.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checkpoint_restore import bench_restore, max_over_ranks  # noqa: E402
from _spawn import spawn_ranks  # noqa: E402

WORK = os.path.join(HERE, ".work", "checkpoint_block")
OUT = os.path.join(HERE, "results", "checkpoint_block.json")
N_TENSORS = 16


class Blob:
    """A stateful holding this rank's shard of the state."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            self.tensors[k].copy_(v)


def _spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _summary(blocked: list[float], durable: list[float]) -> dict:
    """Save 1 apart (it allocates staging buffers, starts DCP's daemon); the rest as spread."""
    later, later_d = blocked[1:] or blocked, durable[1:] or durable
    return {
        "first_s": blocked[0],
        "first_durable_s": durable[0],
        "steady_s": statistics.median(later),
        "blocked": _spread(later),
        "durable": _spread(later_d),
        "all_s": blocked,
        "all_durable_s": durable,
    }


def _dcp_stager(shared_memory: bool):
    """DCP's own stager, set up as its docs recommend and kept for every save.

    ``StagingOptions``: pinned memory, asynchronous staging and non-blocking copies where CUDA
    is available (they need it); shared memory where a second process reads the buffers (the
    process executor). Reusing one ``DefaultStager`` keeps its CPU copies across saves, so
    only the first save allocates (``async_save`` without one allocates on every call).
    """
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=shared_memory,
            use_async_staging=cuda,
            use_non_blocking_copy=cuda,
        )
    )


def _dcp_caching_planners() -> dict:
    """``DefaultSavePlanner(enable_plan_caching=True)``, one class per async executor
    (``_dcp_planners.py`` says why)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from _dcp_planners import ProcessCachingPlanner, ThreadCachingPlanner

    return {
        AsyncCheckpointerType.THREAD: ThreadCachingPlanner(enable_plan_caching=True),
        AsyncCheckpointerType.PROCESS: ProcessCachingPlanner(enable_plan_caching=True),
    }


def _save_contenders(tensors: dict, base: str, pg, rank: int, world: int) -> tuple[dict, list]:
    """name -> fn(rep) returning (blocked_s, durable_s) on this rank; and what to close."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from steadytrain.checkpoint import Checkpointer

    def timed_sync(fn):
        def go(i: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            fn(i)
            t = time.perf_counter() - t0
            return t, t

        return go

    def torch_save_gathered(i: int) -> None:
        flat = torch.cat([t for t in tensors.values()])
        out = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
        dist.gather(flat, out, dst=0)
        if rank == 0:
            path = os.path.join(base, f"torchsave-{i}.pt")
            with open(path, "wb") as f:
                torch.save({"shards": out}, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()

    def dcp_sync(i: int) -> None:
        dcp.save(tensors, checkpoint_id=os.path.join(base, f"dcp-sync-{i}"), process_group=pg)

    def dcp_sync_no_crc(i: int) -> None:
        """DCP sync with torch's zip CRC-32 off (reference: what the CRC costs DCP)."""
        torch.serialization.set_crc32_options(False)
        try:
            dcp.save(tensors, checkpoint_id=os.path.join(base, f"dcp-nocrc-{i}"), process_group=pg)
        finally:
            torch.serialization.set_crc32_options(True)

    planners = _dcp_caching_planners()
    stagers = {
        AsyncCheckpointerType.THREAD: _dcp_stager(shared_memory=False),
        AsyncCheckpointerType.PROCESS: _dcp_stager(shared_memory=True),
    }

    def dcp_async(kind):
        def go(i: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            res = dcp.async_save(
                tensors,
                checkpoint_id=os.path.join(base, f"dcp-{kind.value}-{i}"),
                process_group=pg,
                async_checkpointer_type=kind,
                async_stager=stagers[kind],
                planner=planners[kind],
            )
            upload = getattr(res, "upload_completion", res)
            if upload is not res:  # asynchronous staging (CUDA): the loop waits for the copy
                res.staging_completion.result()
            blocked = time.perf_counter() - t0
            upload.result()  # durable (data and .metadata fsync'd)
            return blocked, time.perf_counter() - t0

        return go

    states = {"blob": Blob(tensors)}
    ours = {
        mode: Checkpointer(os.path.join(base, f"ours-{mode}"), keep_last=2, async_mode=mode)
        for mode in ("thread", "process")
    }

    def ours_save(mode: str):
        def go(i: int) -> tuple[float, float]:
            blocked = ours[mode].save(i + 1, states)
            ours[mode].wait()
            event = ours[mode].last_event
            assert event is not None and event["ok"], event
            return blocked, event["durable_s"]

        return go

    # The memcpy reference: the copy our staging does (np.copyto, one thread) into buffers
    # allocated and touched once, before any timed save, and reused: what staging costs with
    # nothing else. It runs in the rotation like every contender, so it sees the same
    # machine; a contender whose blocked time falls below it in one repetition shows the noise.
    import numpy as np

    bufs = {k: torch.empty_like(t) for k, t in tensors.items()}
    for k, t in tensors.items():
        np.copyto(bufs[k].numpy(), t.numpy())

    def memcpy(i: int) -> None:
        for k, t in tensors.items():
            np.copyto(bufs[k].numpy(), t.numpy())

    contenders = {
        "memcpy_reference": timed_sync(memcpy),
        "torch_save_rank0_gathered": timed_sync(torch_save_gathered),
        "dcp_sync": timed_sync(dcp_sync),
        "dcp_sync_no_crc": timed_sync(dcp_sync_no_crc),
        "dcp_async_thread": dcp_async(AsyncCheckpointerType.THREAD),
        "dcp_async_process": dcp_async(AsyncCheckpointerType.PROCESS),
        "ours_thread": ours_save("thread"),
        "ours_process": ours_save("process"),
    }
    return contenders, [*stagers.values(), *ours.values()]


def _bench_saves(row: dict, tensors: dict, base: str, pg, repeats: int) -> list:
    """Every contender once per repetition, in rotating order; fills ``row``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    contenders, closers = _save_contenders(tensors, base, pg, rank, world)
    names = list(contenders)
    blocked: dict[str, list[float]] = {n: [] for n in names}
    durable: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        orders.append(order)
        for name in order:
            dist.barrier()
            b, d = contenders[name](rep)
            blocked[name].append(max_over_ranks(dist, b))
            durable[name].append(max_over_ranks(dist, d))
        dist.barrier()
        if rank == 0:  # the peers' checkpoints of this repetition (ours: keep_last)
            for p in os.listdir(base):
                if not p.startswith("ours-"):
                    shutil.rmtree(os.path.join(base, p), ignore_errors=True)
                    if os.path.isfile(os.path.join(base, p)):
                        os.remove(os.path.join(base, p))
        dist.barrier()
    row["order"] = orders
    for name in names:
        row[name] = _summary(blocked[name], durable[name])
    # durable after, against DCP sync's whole save in the same repetition (drift-robust)
    from torch.distributed.checkpoint.planner import SavePlanner

    # DCP's plan cache on this rank after the saves (the process executor's lives in its
    # daemon, so only the thread one can be seen here): proof the caching planner was used
    row["dcp_thread_plan_cached"] = "ThreadCachingPlanner" in SavePlanner._cached_global_plan
    row["blocked_vs_memcpy_per_rep"] = {
        mode: [
            b / f for b, f in zip(blocked[mode][1:], blocked["memcpy_reference"][1:], strict=True)
        ]
        for mode in ("ours_thread", "ours_process", "dcp_async_thread", "dcp_async_process")
    }
    row["durable_vs_dcp_sync_per_rep"] = {
        mode: [d / s for d, s in zip(durable[mode][1:], durable["dcp_sync"][1:], strict=True)]
        for mode in ("ours_thread", "ours_process")
    }
    return closers


def bench_size(mib: int, repeats: int, pg, restore_reps: int = 5, only: str = "all") -> dict:
    """All methods at one state size; returns the result row (complete on rank 0)."""
    import torch
    import torch.distributed as dist

    from steadytrain.checkpoint import Checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = (mib << 20) // world
    numel = per_rank // 4 // N_TENSORS
    gen = torch.Generator().manual_seed(rank)
    tensors = {f"r{rank}.t{i}": torch.randn(numel, generator=gen) for i in range(N_TENSORS)}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    row: dict = {"state_mib": mib, "ranks": world, "bytes_per_rank": nbytes}
    base = os.path.join(WORK, f"{mib}")
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
    dist.barrier()

    if only == "restore":
        ck_dir = os.path.join(base, "ours-thread")
        ckpt = Checkpointer(ck_dir, keep_last=2, async_mode="thread")
        for i in range(repeats):
            ckpt.save(i + 1, {"blob": Blob(tensors)})
        ckpt.close()
        closers: list = []
    else:
        closers = _bench_saves(row, tensors, base, pg, repeats)
    row["restore"] = bench_restore(
        os.path.join(base, "ours-thread"), repeats, {"blob": Blob(tensors)}, rank, restore_reps
    )
    for c in closers:
        c.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        row["targets"] = _targets(row, only)
        print(json.dumps(row, indent=1), flush=True)
    dist.barrier()
    return row


def _targets(row: dict, only: str) -> dict:
    """Ratios of medians (steady saves), and whether each target is met."""
    # Restore against the bytes read with as many readers as the restore has (both ranks
    # reading their own files at once); the one-reader sequential read stays in the JSON.
    rs = row["restore"]
    out = {
        "restore_full_vs_parallel_read": rs["ratio_full_vs_parallel_read"],
        "restore_overlap_vs_parallel_read": rs["ratio_overlap_vs_parallel_read"],
        "dcp_load_vs_parallel_read": rs["ratio_dcp_load_unverified_vs_parallel_read"],
        "meets_restore_1_3x": rs["ratio_full_vs_parallel_read"] <= 1.3,
        "meets_restore_1_3x_overlap": rs["ratio_overlap_vs_parallel_read"] <= 1.3,
    }
    if only == "restore":
        return out
    med = {
        n: row[n]["blocked"]["median"]
        for n in row
        if isinstance(row[n], dict) and "blocked" in row[n]
    }
    dur = {n: row[n]["durable"]["median"] for n in med}
    floor = med["memcpy_reference"]
    ours = med["ours_thread"]
    return {
        "ours_vs_dcp_sync": ours / med["dcp_sync"],
        "ours_vs_dcp_async_thread": ours / med["dcp_async_thread"],
        "ours_process_vs_dcp_async_process": med["ours_process"] / med["dcp_async_process"],
        "ours_vs_memcpy": ours / floor,
        "dcp_async_thread_vs_memcpy": med["dcp_async_thread"] / floor,
        "meets_1_5_of_dcp_sync": ours <= med["dcp_sync"] / 5,
        "meets_2x_memcpy": ours <= 2 * floor,
        "durable_vs_dcp_sync": dur["ours_thread"] / dur["dcp_sync"],
        "durable_process_vs_dcp_sync": dur["ours_process"] / dur["dcp_sync"],
        "durable_vs_dcp_async_thread": dur["ours_thread"] / dur["dcp_async_thread"],
        "durable_vs_dcp_sync_no_crc": dur["ours_thread"] / dur["dcp_sync_no_crc"],
        "meets_durable_1_2x_dcp_sync": dur["ours_thread"] <= 1.2 * dur["dcp_sync"],
        **out,
    }


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pg = dist.new_group(backend="gloo")
    load_start = os.getloadavg()
    results = [
        bench_size(mib, args.repeats, pg, args.restore_reps, args.only) for mib in args.sizes_mib
    ]
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        doc = {
            "benchmark": "checkpoint_block",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {"cpus": os.cpu_count(), "torch": torch.__version__},
            "command": " ".join(["bench/checkpoint_block.py", *sys.argv[1:]]),
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "repeats": args.repeats,
            "note": (
                "blocked = seconds until control returns to the loop, durable = seconds from "
                "the save call until the checkpoint is durable (ours: COMMIT fsync'd), both "
                "the max over ranks; save 1 is reported apart (first_s), the spread is over "
                "saves 2..repeats; contenders run once per repetition in rotating order"
            ),
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=7, help="saves per contender (1 + spread)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--restore-reps", type=int, default=5, help="interleaved cold restores")
    ap.add_argument(
        "--only", choices=("all", "restore"), default="all", help="restore: skip the save peers"
    )
    ap.add_argument("--out", default=OUT, help="where the JSON goes")
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    procs = spawn_ranks(__file__, args.ranks, sys.argv[1:])
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
