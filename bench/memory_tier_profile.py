"""Where a memory-tier restore's seconds go: per-phase medians of local- and peer-memory
restores, 2 ranks on CPU (gloo), the job of bench/memory_tier.py (130 MB of state a rank).

    .venv/bin/python bench/memory_tier_profile.py [--reps 7] [--remote]

Rank r runs as node-r with its memory in its own /dev/shm directory. One snapshot and one
durable save of a step; then, ``--reps`` times, a local-memory restore (each rank reads its
node's copy) and a peer-memory restore (node-1's memory moved aside: rank 1 receives its
copy from node-0), each through a new ``Checkpointer``. Phases are timed by wrapping the
tier's functions: ``scan`` (the node's copies, headers), ``all_gather`` (the agreements),
``post`` (posting the transfer, with ``anon``: mapping the receive buffer), ``fetch``
(waiting for it; in an older tree, both), ``map_file`` (the holder mapping the copy it
sends), ``parse`` (checksum and decode), ``check_copy``,
``own`` (the optimizer's tensors copied out of the buffer), ``apply`` (loading the
states), ``listing`` (rank 0 listing the durable store, on a thread beside the scan),
``total``. Interleaved with them, ``transfer-floor``: the same copy sent from rank 0 to
rank 1 into fresh memory and checksummed, and nothing else (``_Floor``). ``--remote``: durable checkpoints also go to a SeaweedFS server on 127.0.0.1,
as in bench/memory_tier.py, so the listing is the object store's. Prints one line per rank and tier; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import memory_tier as MT  # noqa: E402
from _memory_tier_restore import spawn_nodes  # noqa: E402

WORK = os.path.join(HERE, ".work", "memory_tier_profile")
MEMORY_ROOT = os.path.join("/dev/shm", "steadytrain-bench-memory-profile")


def _timer(acc: dict, obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` so its outermost calls add their seconds to ``acc[label]`` (absent
    in an older tree: not timed)."""
    if obj is None or not hasattr(obj, name):
        return
    inner, depth = getattr(obj, name), [0]

    def timed(*a, **k):
        t0 = time.perf_counter()
        depth[0] += 1
        try:
            return inner(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                acc[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from steadytrain.checkpoint import checkpointer as C
    from steadytrain.checkpoint import state as S
    from steadytrain.checkpoint.memory import peers
    from steadytrain.checkpoint.memory import snapshot as snap
    from steadytrain.checkpoint.memory import tier as T
    from steadytrain.checkpoint.memory.store import Store
    from steadytrain.checkpoint.writer import Group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    job = MT.Job(argparse.Namespace(seq=256, layers=6, embd=384, batch=4), rank)
    acc: dict[str, float] = collections.defaultdict(float)
    for obj, name, label in (
        (peers, "fetch", "fetch"),  # an older tree's transfer
        (getattr(peers, "Transfer", None), "__init__", "post"),
        (getattr(peers, "Transfer", None), "wait", "fetch"),
        (snap, "anonymous", "anon"),
        (snap, "map_file", "map_file"),
        (snap, "parse", "parse"),
        (Group, "all_gather", "all_gather"),
        (S, "apply_dcp_state_dict", "apply"),
        (T, "_own", "own"),
        (T, "check_copy", "check_copy"),
        (Store, "scan", "scan"),
        (C, "newest_durable_step", "listing"),
    ):
        _timer(acc, obj, name, label)
    ck = MT._checkpointer(args.work, 1, [], remote=args.remote)
    job.step()
    ck.maybe_save(1000, job.states)
    ck.save(1000, job.states)
    ck.wait()
    root = ck.memory.store.root
    rows: dict[str, list[dict]] = collections.defaultdict(list)
    floor = _Floor(ck.memory.store.path(0, 1000), rank)
    for _ in range(args.reps):
        for tier in ("local-memory", "peer-memory", "transfer-floor"):
            if tier == "transfer-floor":
                rows[tier].append({"total": floor.run()})
                continue
            job.disturb()
            lose = tier == "peer-memory" and rank == 1
            if lose:
                os.rename(root, root + ".away")
                os.makedirs(root)
            fresh = MT._checkpointer(args.work, 1, [], remote=args.remote)
            acc.clear()
            dist.barrier()
            t0 = time.perf_counter()
            fresh.restore_latest(job.states)
            total = time.perf_counter() - t0
            fresh.close()
            if lose:
                shutil.rmtree(root, ignore_errors=True)
                os.rename(root + ".away", root)
            dist.barrier()
            rows[tier].append({"total": total, **acc})
    for tier, got in rows.items():
        keys = sorted(set().union(*got))
        med = {k: statistics.median(r.get(k, 0.0) for r in got) for k in keys}
        print(f"rank {rank} {tier}: " + " ".join(f"{k} {v:.3f}" for k, v in med.items()))
    ck.close()
    dist.destroy_process_group()


class _Floor:
    """The least a peer restore can cost here: rank 0's copy (mapped from its file) sent
    to rank 1, which maps fresh memory for it (``snapshot.anonymous``), receives it and
    checksums it (``payload_digest``): no agreement, no decoding, no loading."""

    def __init__(self, path: str, rank: int) -> None:
        import torch
        import torch.distributed as dist

        from steadytrain.checkpoint.memory import snapshot as snap

        self.rank, self.snap = rank, snap
        self.image = snap.map_file(path, readonly=True) if rank == 0 else None
        size = torch.tensor([0 if self.image is None else len(self.image)])
        dist.broadcast(size, 0)
        self.nbytes = int(size.item())

    def run(self) -> float:
        import torch
        import torch.distributed as dist

        from steadytrain.checkpoint.memory import peers

        dist.barrier()
        t0 = time.perf_counter()
        if self.rank == 0:
            dist.send(peers._readable(self.image), 1)
        elif self.rank == 1:
            buf = self.snap.anonymous(self.nbytes)
            dist.recv(torch.from_numpy(buf), 0)
            self.snap.payload_digest(buf)
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--work", default=WORK)
    ap.add_argument("--remote", action="store_true", help="durable copies to SeaweedFS too")
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    shutil.rmtree(MEMORY_ROOT, ignore_errors=True)
    shutil.rmtree(args.work, ignore_errors=True)
    server = MT.start_store(args.work) if args.remote else None
    procs = spawn_nodes(__file__, MEMORY_ROOT)
    try:
        return max(p.wait() for p in procs)
    finally:
        shutil.rmtree(MEMORY_ROOT, ignore_errors=True)
        shutil.rmtree(args.work, ignore_errors=True)
        MT.stop_store(server)


if __name__ == "__main__":
    sys.exit(main())
