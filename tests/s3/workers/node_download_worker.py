"""One rank of the per-node download test (tests/s3/test_checkpoint_restore_per_node.py).

Three ranks on two nodes (ranks 0 and 1 on node a, sharing its local directory; rank 2 on
node b, with its own) save steps 1 and 2 to the object store, then restore as spares with
empty local directories, four times. Every rank has the same ``STEADYTRAIN_NODE`` (as
containers with one host name would): who shares a directory must come from the
directories themselves.

1. ``intact``: the newest checkpoint, downloaded once per node;
2. ``unwritable``: rank 1 cannot write its part of node-a's download (a directory stands
   where its first file goes, made just before the real download runs);
3. ``damaged``: after the test's own hand damages a file of step 2 in the store
   (``ROOT/damage``: the worker waits for it), the restore falls back to step 1;
4. ``shared``: all three ranks restore into one directory (a filesystem the nodes share):
   the files are split three ways.

Each rank prints one JSON line: per round its restore event (or the error it raised), its
weights after the round, the files it asked the store for (a spy around the real
download) and the ``.restore-*`` entries left in its local directory.

usage: node_download_worker.py ROOT URL OPTIONS_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint import remote as remote_mod
from steadytrain.errors import CheckpointError

NODES = {0: "a", 1: "a", 2: "b"}  # each node's local directory


def _states(value: float) -> dict:
    model = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model}


def _restore(local: str, url: str, opts: dict) -> dict:
    events: list[dict] = []
    ck = Checkpointer(
        local, async_mode="sync", remote=url, storage_options=opts, on_event=events.append
    )
    states = _states(-1.0)
    out: dict = {}
    try:
        out["step"] = ck.restore_latest(states)
        (out["event"],) = [e for e in events if e["type"] == "restore"]
    except CheckpointError as exc:
        out["error"] = str(exc)
    ck.close()
    dist.barrier()  # every rank is done before the directories are looked at
    weight = states["model"].weight
    out["weights"] = sorted({float(v) for v in weight.flatten().tolist()})
    out["left"] = sorted(n for n in os.listdir(local) if n.startswith(".restore-"))
    return out


def _spy(into: list[str]) -> None:
    """Record the files each download of this rank asks the store for (the real one runs)."""
    real = remote_mod.Root.download

    def download(self, name, files, local_dir):  # noqa: ANN001 - the method's own
        into.extend(files)
        return real(self, name, files, local_dir)

    remote_mod.Root.download = download


def _unwritable_once() -> None:
    """Rank 1's next download finds a directory where its first file goes."""
    real = remote_mod.Root.download

    def download(self, name, files, local_dir):  # noqa: ANN001 - the method's own
        remote_mod.Root.download = real
        os.makedirs(os.path.join(local_dir, files[0]), exist_ok=True)
        return real(self, name, files, local_dir)

    remote_mod.Root.download = download


def main() -> None:
    root, url, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    os.environ["STEADYTRAIN_NODE"] = "host-1"
    dist.init_process_group("gloo")
    node = NODES[rank]
    saver = Checkpointer(
        os.path.join(root, f"save-{node}"),
        every_steps=1,
        async_mode="sync",
        remote=url,
        storage_options=opts,
    )
    for step in (1, 2):
        saver.maybe_save(step, _states(float(step)))
    saver.close()
    dist.barrier()
    rounds = {}
    asked: list[str] = []
    _spy(asked)
    for name in ("intact", "unwritable", "damaged", "shared"):
        if name == "unwritable" and rank == 1:
            _unwritable_once()
        if name == "damaged":
            if rank == 0:
                with open(os.path.join(root, "ready"), "w") as f:
                    f.write("damage step 2 now")
                while not os.path.exists(os.path.join(root, "damage")):
                    time.sleep(0.05)
            dist.barrier()
        local = os.path.join(root, f"spare-{name}-{'all' if name == 'shared' else node}")
        os.makedirs(local, exist_ok=True)
        rounds[name] = _restore(local, url, opts)
        rounds[name]["asked"], asked[:] = sorted(asked), []
    print("RESULT " + json.dumps({"rank": rank, "node": node, "rounds": rounds}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
