"""How much host RAM does the checkpoint memory tier hold per rank (issue 40, item 8)?

    .venv/bin/python bench/memory_tier_ram.py              # ≈ 1 min on 2 cores
    .venv/bin/python bench/memory_tier_ram.py --mib 256    # the state size per rank

Two ranks on CPU (gloo), each on its own simulated node (``STEADYTRAIN_NODE=node-r``, its
own memory directory under one fresh folder of /dev/shm), so each rank's copy also goes to
the other node, as on a cluster. Each rank holds ``--mib`` MiB of state (a linear layer's
weights and an SGD momentum buffer of the same size), snapshots it into memory every step
for ``--steps`` steps (no durable saves) and closes its ``Checkpointer``.

Per rank, from ``/proc/self/status``: ``RssAnon`` (the process's own memory: the states
and the tier's staging buffers) and ``RssShmem`` (tmpfs pages the process has mapped),
before the tier, after the snapshots, and after ``close()``; and the bytes of the node's
memory directory (``tmpfs_bytes``: the rank's two generations and the two it keeps for its
peer). Everything is also given as a multiple of the state. Writes
``bench/results/memory_tier_ram.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total


def rank_main(out: str, mib: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from steadytrain.checkpoint import Checkpointer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    n = int((mib << 20) / 2 / 4) // 1024  # weights + momentum, fp32, 1024 columns
    model = nn.Linear(1024, n, bias=False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 1024)).sum().backward()
    optim.step()  # the momentum buffer exists
    states = {"model": model, "optim": optim}
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 2
    before = _status()
    ckpt = Checkpointer(
        os.path.join(out, "ckpt"),
        job_id="ram",
        memory={"every_steps": 1, "budget_bytes": 1 << 40},
    )
    ckpt.restore_latest(states)
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.maybe_save(step, states)
    ckpt.wait()
    dist.barrier()
    during = _status()
    tmpfs = _du(os.environ["STEADYTRAIN_MEMORY_DIR"])
    ckpt.close()
    after = _status()
    result = {
        "rank": rank,
        "state_bytes": state_bytes,
        "tmpfs_bytes": tmpfs,
        "before": before,
        "snapshotting": during,
        "after_close": after,
        "x_state": {
            "tmpfs": round(tmpfs / state_bytes, 2),
            "process_anon_added": round((during["RssAnon"] - before["RssAnon"]) / state_bytes, 2),
            "process_anon_after_close": round(
                (after["RssAnon"] - before["RssAnon"]) / state_bytes, 2
            ),
            "shmem_mapped": round(during["RssShmem"] / state_bytes, 2),
            "shmem_mapped_after_close": round(after["RssShmem"] / state_bytes, 2),
        },
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="state per rank, MiB")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank-of", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory_tier_ram.json"))
    args = ap.parse_args()
    if args.rank_of:  # a rank started below
        rank_main(args.rank_of, args.mib, args.steps)
        return
    from _spawn import spawn_ranks

    work = tempfile.mkdtemp(prefix="memtier-ram-", dir="/dev/shm")
    try:
        argv = ["--rank-of", work, "--mib", str(args.mib), "--steps", str(args.steps)]
        procs = spawn_ranks(
            os.path.abspath(__file__),
            2,
            argv,
            lambda r: {
                "STEADYTRAIN_NODE": f"node-{r}",
                "STEADYTRAIN_MEMORY_DIR": os.path.join(work, f"node-{r}"),
            },
        )
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a rank failed")
        ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"mib_per_rank": args.mib, "steps": args.steps, "ranks": ranks}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in ranks:
        print(
            f"rank {r['rank']}: state {r['state_bytes'] / 2**20:.0f} MiB, x state: {r['x_state']}"
        )


if __name__ == "__main__":
    main()
