"""Helpers of bench/memory_tier.py: restore seconds per tier on the same states.

Both ranks restore every time (equal reader counts), every tier once per repetition, in an
order that rotates by one place per repetition: ``local-memory`` (each node's own copy),
``peer-memory`` (node-1's memory moved aside: rank 1 fetches from node-0), ``durable``
(both nodes' memory moved aside, the checkpoint's files dropped from the page cache first)
and ``durable_warm`` (the same, files in the page cache). Each restore is checked: its
event's tier and step, and every weight bit for bit (they are disturbed before each).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

from _checkpoint_restore import timed
from _spawn import spawn_ranks

TIERS = ("local-memory", "peer-memory", "durable", "durable_warm", "durable-remote")


def spawn_nodes(script: str, memory_root: str) -> list[subprocess.Popen]:
    """``script`` (with this process's arguments) as 2 ranks on 2 simulated nodes: rank r
    is ``node-r``, its memory tier in ``memory_root/node-r``, one thread."""
    return spawn_ranks(
        script,
        2,
        sys.argv[1:],
        lambda r: {
            "STEADYTRAIN_NODE": f"node-{r}",
            "STEADYTRAIN_MEMORY_DIR": os.path.join(memory_root, f"node-{r}"),
        },
    )


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def rotate(names: list, i: int) -> list:
    k = i % len(names)
    return names[k:] + names[:k]


def sum_over_ranks(dist, x: float) -> float:
    import torch

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _evict(directory: str) -> None:
    """Drop a checkpoint's files from the page cache (fsync, then FADV_DONTNEED)."""
    for d, _, files in os.walk(directory):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_all(directory: str) -> None:
    for d, _, files in os.walk(directory):
        for n in files:
            with open(os.path.join(d, n), "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass


def bench_restore(make, base: str, job, rank: int, reps: int, remote: bool = False) -> dict:
    """Restore seconds per tier on the same states, both ranks, rotating order. ``make``:
    ``make(events)``, a new Checkpointer on ``base`` with the memory tier every step, its
    events into the list ``events``; every restore gets a new one, as a restarted process
    has (its buffers are allocated by that restore). ``job``: the bench's model and
    optimizer (``states``, ``step()``, ``disturb()``). ``remote``: ``make`` copies every
    durable checkpoint to the object store, and ``durable-remote`` is timed too: a spare
    with neither memory nor a local disk copy, restoring from the object store into a
    local directory of its own node (``make(events, directory)``: each rank its own, as
    on two machines, so each downloads the whole checkpoint; ranks sharing one directory
    would split one download between them)."""
    import torch
    import torch.distributed as dist

    from steadytrain.checkpoint.commit import parse_dirname

    ck = make([])  # the saving one, open until the end (its close would drop the snapshots)
    step = 1000  # any step: one snapshot and one durable save of it
    job.step()
    ck.maybe_save(step, job.states)  # the memory tier's generation (every step)
    ck.save(step, job.states)  # and the durable checkpoint of the same step
    ck.wait()
    params = list(job.model.module.parameters())
    saved = [p.detach().clone() for p in params]
    root = ck.memory.store.root
    stash = root + ".away"
    [step_dir] = [os.path.join(base, n) for n in os.listdir(base) if parse_dirname(n)]
    ck_bytes = sum(
        os.path.getsize(os.path.join(d, n)) for d, _, fs in os.walk(step_dir) for n in fs
    )

    def away(ranks: tuple[int, ...]) -> None:
        """Those ranks' nodes lose their memory (moved aside, put back by ``back``)."""
        if rank in ranks:
            os.rename(root, stash)
            os.makedirs(root)  # the tier's directory, empty, as a fresh node has it

    def back(ranks: tuple[int, ...]) -> None:
        if rank in ranks:
            shutil.rmtree(root, ignore_errors=True)  # a close() may have removed it
            os.rename(stash, root)

    lost = {
        "local-memory": (),
        "peer-memory": (1,),
        "durable": (0, 1),
        "durable_warm": (0, 1),
        "durable-remote": (0, 1),
    }
    tiers = [t for t in TIERS if remote or t != "durable-remote"]
    disk_copy = step_dir + ".away"

    def disk(lose: bool) -> None:
        """The nodes' local disk copy of the checkpoint gone (a spare's empty disk), or
        back; both ranks share this machine's directory: rank 0 moves it."""
        if rank == 0:
            os.rename(*((step_dir, disk_copy) if lose else (disk_copy, step_dir)))
        dist.barrier()

    times: dict[str, list[float]] = {t: [] for t in tiers}
    moved: dict[str, list] = {t: [] for t in tiers}
    for rep in range(reps):
        for tier in rotate(tiers, rep):
            job.disturb()
            away(lost[tier])
            if tier == "durable-remote":
                disk(lose=True)
            if tier == "durable" and rank == 0:
                _evict(step_dir)
            elif tier == "durable_warm" and rank == 0:
                _read_all(step_dir)
            events: list = []
            spare = f"{base}.spare-node{rank}"  # this node's own local disk, empty
            fresh = make(events, spare) if tier == "durable-remote" else make(events)
            t = timed(dist, lambda: fresh.restore_latest(job.states))  # noqa: B023 - called here
            fresh.close()
            back(lost[tier])
            if tier == "durable-remote":
                dist.barrier()
                shutil.rmtree(spare, ignore_errors=True)  # whatever the restore left there
                disk(lose=False)
            [ev] = [e for e in events if e.get("type") == "restore"]
            want = "durable" if tier.startswith("durable") else tier
            assert ev["tier"] == want and ev["step"] == step, (tier, ev)
            same = all(torch.equal(p, q) for p, q in zip(params, saved, strict=True))
            assert same, f"{tier}: the restored weights differ from the saved ones"
            got: list = [None] * dist.get_world_size()
            moved_here = tuple(ev.get(k, 0) for k in ("bytes_local", "bytes_peer", "bytes_remote"))
            dist.all_gather_object(got, moved_here)
            times[tier].append(t)
            moved[tier].append(got)
    ck.close()
    shutil.rmtree(root, ignore_errors=True)
    out: dict = {"reps": reps, "order": "rotating, interleaved", "step": step}
    for tier in tiers:
        out[tier] = {
            "s": spread(times[tier]),
            "all_s": times[tier],
            "bytes_local_per_rank": [b[0] for b in moved[tier][0]],
            "bytes_peer_per_rank": [b[1] for b in moved[tier][0]],
            "bytes_remote_per_rank": [b[2] for b in moved[tier][0]],
        }
    out["durable"]["checkpoint_bytes"] = out["durable_warm"]["checkpoint_bytes"] = ck_bytes
    out["durable"]["cold"] = "fsync + POSIX_FADV_DONTNEED before each"
    med = {t: out[t]["s"]["median"] for t in tiers}
    out["ratio_durable_vs_peer"] = med["durable"] / med["peer-memory"]
    out["ratio_durable_vs_peer_per_rep"] = [
        d / p for d, p in zip(times["durable"], times["peer-memory"], strict=True)
    ]
    out["ratio_durable_warm_vs_peer"] = med["durable_warm"] / med["peer-memory"]
    out["ratio_durable_vs_local"] = med["durable"] / med["local-memory"]
    if remote:
        out["durable-remote"]["checkpoint_bytes"] = ck_bytes
        out["durable-remote"]["store"] = "SeaweedFS on 127.0.0.1 (S3 API), started by the bench"
        out["ratio_durable_remote_vs_peer"] = med["durable-remote"] / med["peer-memory"]
        out["ratio_durable_remote_vs_peer_per_rep"] = [
            d / p for d, p in zip(times["durable-remote"], times["peer-memory"], strict=True)
        ]
        out["ratio_durable_remote_vs_local"] = med["durable-remote"] / med["local-memory"]
    return out
