"""What does sharing one download per node buy a remote restore?

    .venv/bin/python bench/remote_restore_node.py [--ranks 4] [--mb 64] [--reps 7]   # ≈ 1 min

``--ranks`` ranks on this machine (gloo, one thread each) save one checkpoint of a
replicated model of about ``--mb`` MB to a SeaweedFS server on 127.0.0.1 (started here, as
in bench/memory_tier.py), then restore it as spares with empty local directories, the two
ways interleaved in rotating order, ``--reps`` times:

- ``shared``: the ranks share one local directory (the ranks of one node): they download
  the checkpoint once between them, each a part of its files (``checkpoint/download.py``);
- ``per-rank``: each rank has a local directory of its own, which the restore treats as
  a node of its own: each downloads the whole checkpoint. This is what every rank of a
  node did before the download was shared.

A restore's time is the slowest rank's, from a barrier to its return; each restore is
checked (step, every weight bit for bit) and its ``bytes_remote`` summed over ranks.
Writes JSON to bench/results/remote_restore_node.json.
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
from _spawn import spawn_ranks  # noqa: E402
from memory_tier import _remote, start_store, stop_store  # noqa: E402

WORK = os.path.join(HERE, ".work", "remote_restore_node")
OUT = os.path.join(HERE, "results", "remote_restore_node.json")
MODES = ("shared", "per-rank")


def _model(mb: int, seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    width = 1024
    layers = max(1, mb * (1 << 20) // (4 * width * width))
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from steadytrain.checkpoint import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    url, opts = _remote()
    saved = _model(args.mb, 0)
    ck = Checkpointer(
        os.path.join(args.work, "save"), async_mode="sync", remote=url, storage_options=opts
    )
    ck.save(1, {"model": saved})
    ck.close()
    dist.barrier()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    moved: dict[str, list[int]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        k = rep % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            local = os.path.join(
                args.work, "spare-shared" if mode == "shared" else f"spare-rank{rank}"
            )
            model = _model(args.mb, 1)  # other weights: the restore must bring the saved ones
            events: list[dict] = []
            fresh = Checkpointer(
                local,
                async_mode="sync",
                remote=url,
                storage_options=opts,
                on_event=events.append,
            )
            dist.barrier()
            t0 = time.perf_counter()
            step = fresh.restore_latest({"model": model})
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            fresh.close()
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            (ev,) = [e for e in events if e["type"] == "restore"]
            same = all(
                torch.equal(p, q)
                for p, q in zip(model.parameters(), saved.parameters(), strict=True)
            )
            assert step == 1 and same, (mode, step, same)
            got = torch.tensor([ev["bytes_remote"]], dtype=torch.int64)
            dist.all_reduce(got)
            times[mode].append(float(took.item()))
            moved[mode].append(int(got.item()))
            dist.barrier()
            if rank == 0 or mode == "per-rank":
                shutil.rmtree(local, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        out: dict = {
            "ranks": world,
            "reps": args.reps,
            "order": "rotating, interleaved",
            "store": "SeaweedFS on 127.0.0.1 (S3 API), started by the bench",
            "load_before": args.load_before,
        }
        for mode in MODES:
            xs = times[mode]
            out[mode] = {
                "s": {"min": min(xs), "median": statistics.median(xs), "max": max(xs)},
                "all_s": xs,
                "bytes_downloaded_all_ranks": moved[mode],
            }
        out["ratio_per_rank_vs_shared"] = (
            out["per-rank"]["s"]["median"] / out["shared"]["s"]["median"]
        )
        out["ratio_per_rep"] = [
            p / s for p, s in zip(times["per-rank"], times["shared"], strict=True)
        ]
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=int, default=64, help="the model's size (fp32 weights)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--work", default=WORK)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--load-before", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    server = start_store(args.work)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        procs = spawn_ranks(__file__, args.ranks, [*sys.argv[1:], "--load-before", load])
        return max(p.wait() for p in procs)
    finally:
        stop_store(server)
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
