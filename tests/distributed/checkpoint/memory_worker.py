"""One rank of the memory tier tests (tests/distributed/test_memory_tier.py).

usage: memory_worker.py CKPT REFS OUT TAG UNTIL END [WIDTH [PARALLEL]]  (RANK, WORLD_SIZE, MASTER_*,
STEADYTRAIN_NODE, STEADYTRAIN_MEMORY_DIR set by memory_launch.py)

Restores (memory tier every step, durable every 4 steps, sync), compares what it restored
with the reference this rank wrote at that step (every tensor of model and optimizer, the
JSON states, the next draws of every RNG) and writes ``OUT/TAG-rankR.json``; then trains
until step UNTIL, writing the reference of each step before its snapshot, and ends with
END: ``crash`` (waits for the last generation, then exits without close, like a killed
job), ``close`` (a clean end), or ``forever`` (trains until killed). PARALLEL: ``ddp``
(the default) or ``fsdp`` (FSDP2 ``fully_shard``: every model and optimizer tensor a
sharded ``DTensor``; the references hold each rank's local shards).
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.config import CheckpointerConfig
from steadytrain.checkpoint.memory.config import MemoryConfig

DURABLE_EVERY = 4


class Cursor:
    """A loader stand-in with a JSON state (ints, a float, a list)."""

    def __init__(self) -> None:
        self.cursor, self.loss, self.seen = 0, 0.0, []

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "loss": self.loss, "seen": list(self.seen)}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor, self.loss, self.seen = sd["cursor"], sd["loss"], list(sd["seen"])


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def _copy(x):
    """A plain copy of a tensor (a DTensor's local shard), anything else as it is."""
    if isinstance(x, DTensor):
        return x.to_local().clone()
    return x.clone() if isinstance(x, torch.Tensor) else x


def reference(model, optim, sched, cursor) -> dict:
    """Everything a restore of this step must reproduce; the RNG draws leave the RNG as is."""
    rng = S.rng_state()
    draws = [torch.rand(4).tolist(), random.random(), float(np.random.rand())]
    S.set_rng_state(rng)
    return {
        "model": {k: _copy(v) for k, v in get_model_state_dict(model).items()},
        "optim": torch.utils._pytree.tree_map(_copy, get_optimizer_state_dict(model, optim)),
        "json": {"sched": sched.state_dict(), "cursor": cursor.state_dict()},
        "draws": draws,
    }


def differences(now: dict, ref: dict) -> list[str]:
    out = []
    for part in ("model", "optim"):
        a, spec_a = torch.utils._pytree.tree_flatten(now[part])
        b, spec_b = torch.utils._pytree.tree_flatten(ref[part])
        if spec_a != spec_b:
            out.append(f"{part}: structure differs")
            continue
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same = (
                isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
                if isinstance(x, torch.Tensor)
                else x == y
            )
            if not same:
                out.append(f"{part} leaf {i} differs")
    for key in ("json", "draws"):
        if now[key] != ref[key]:
            out.append(f"{key}: {now[key]} != {ref[key]}")
    return out


# "RANK:N": that rank's N-th snapshot reaches its peer with a payload byte flipped, in
# transit only (its own copy and the staged states are untouched): the fault, injected
CORRUPT_SEND = "MEMTEST_CORRUPT_SEND"


def _corrupt_sends(rank: int) -> bool:
    """Arm ``CORRUPT_SEND`` on this rank; whether a fault is injected in this job."""
    spec = os.environ.get(CORRUPT_SEND)
    if not spec:
        return False
    who, nth = (int(x) for x in spec.split(":"))
    if rank == who:
        from steadytrain.checkpoint.memory import peers

        inner, calls = peers.exchange, [0]

        def exchange(pg, peer, image, owners, *args, **kwargs):
            calls[0] += 1
            if image is not None and calls[0] == nth:
                image = image.copy()
                image[-10] ^= 0xFF
            return inner(pg, peer, image, owners, *args, **kwargs)

        peers.exchange = exchange
    return True


# "RANK:OWNER": right after that rank's scan (which agreed the copies' sizes), the newest
# copy of OWNER it holds grows by a page, as a file replaced in between would: the fault
GROW_AFTER_SCAN = "MEMTEST_GROW_AFTER_SCAN"


def _grow_after_scan(rank: int) -> None:
    spec = os.environ.get(GROW_AFTER_SCAN)
    if not spec:
        return
    who, owner = (int(x) for x in spec.split(":"))
    if rank == who:
        from steadytrain.checkpoint.memory.store import Store

        inner = Store.scan

        def scan(self, *args, **kwargs):
            found, passed = inner(self, *args, **kwargs)
            if owner in found:
                with open(self.path(owner, max(found[owner])), "ab") as f:
                    f.write(b"\0" * 4096)
            return found, passed

        Store.scan = scan


def main() -> None:
    ckpt_dir, refs, out, tag, until, end = sys.argv[1:7]
    width = int(sys.argv[7]) if len(sys.argv) > 7 else 32
    parallel = sys.argv[8] if len(sys.argv) > 8 else "ddp"
    until_step = int(until)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    injected = _corrupt_sends(rank)
    _grow_after_scan(rank)
    torch.manual_seed(1000 + rank)  # a fresh job: weights differ from any saved state
    random.seed(rank)
    np.random.seed(rank)
    net = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 8))
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = fully_shard(net)
    else:
        model = nn.parallel.DistributedDataParallel(net)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    cursor = Cursor()
    states = {"model": model, "optim": optim, "sched": sched, "cursor": cursor}
    events: list[dict] = []
    cfg = CheckpointerConfig(
        every_steps=DURABLE_EVERY,
        async_mode="sync",
        job_id="memtest",
        memory=MemoryConfig(every_steps=1),
    )
    ckpt = Checkpointer(ckpt_dir, config=cfg, on_event=events.append)
    step = ckpt.restore_latest(states)
    restore = next(e for e in events if e["type"] == "restore")
    result = {"rank": rank, "world": world, "step": step, "tier": restore["tier"], "diff": []}
    result.update({k: restore[k] for k in ("bytes_local", "bytes_peer", "tokens_seen")})
    result["skipped"] = [s["reason"][:300] for s in restore["skipped"]]
    if step:
        ref = torch.load(os.path.join(refs, f"rank{rank}-step{step}.pt"), weights_only=False)
        result["diff"] = differences(reference(model, optim, sched, cursor), ref)
    path = os.path.join(out, f"{tag}-rank{rank}.json")
    _write_atomic(path, lambda p: open(p, "w").write(json.dumps(result)))
    s = step
    while s < until_step or end == "forever":
        s += 1
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean() * (1 + random.random() + float(np.random.rand()))
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        cursor.cursor, cursor.loss = s * 16, loss.item()
        cursor.seen = (cursor.seen + [s])[-3:]
        ref = reference(model, optim, sched, cursor)
        ref_path = os.path.join(refs, f"rank{rank}-step{s}.pt")
        _write_atomic(ref_path, lambda p, r=ref: torch.save(r, p))
        ckpt.maybe_save(s, states, tokens_seen=s * 100)
    ckpt.wait()
    snaps = [e for e in events if e["type"] == "memory_snapshot"]
    bad = [e for e in snaps if not e["ok"]]
    if injected:  # the test judges what the tier said about the fault
        seen = [{k: e[k] for k in ("step", "ok", "error")} for e in snaps]
        path = os.path.join(out, f"{tag}-rank{rank}-snapshots.json")
        _write_atomic(path, lambda p: open(p, "w").write(json.dumps(seen)))
    else:
        assert not bad, bad
    if end == "crash":
        print(f"rank {rank} crash at {s}", flush=True)
        os._exit(0)  # no close: the memory tier's directory stays, as after a crash
    ckpt.close()
    dist.destroy_process_group()
    print(f"rank {rank} done at {s}", flush=True)


if __name__ == "__main__":
    main()
