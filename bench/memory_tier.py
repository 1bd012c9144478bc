"""What does the checkpoint memory tier cost a step, and how fast does each tier restore?

    .venv/bin/python bench/memory_tier.py                      # ≈ 10 min on 2 cores
    .venv/bin/python bench/memory_tier.py --rounds 2 --steps 10 --restore-reps 3  # quick

One run, 2 ranks on CPU (gloo), each on its own simulated node: rank r runs with
``STEADYTRAIN_NODE=node-r`` and ``STEADYTRAIN_MEMORY_DIR=<memory root>/node-r`` (a directory
of /dev/shm: RAM), so each rank's peer copy goes to the other "node" over loopback TCP on
the tier's own gloo group, as it would between machines (at loopback's speed, not a
network's). The job trains a GPT (``steadytrain.train.model``: 6 layers, d=384, 4 x 256
tokens a step; about 0.7 s a step on one core) under DDP with AdamW: 130 MB of state per
rank (weights and both moments).

**Step overhead**: the same training steps with no memory tier and with snapshots every K
steps (K = 1, 2, 5, 10; no durable saves), each K its own ``Checkpointer`` made once. Every
round runs every configuration once for ``--steps`` steps, in an order that rotates by one
place per round; a segment's time runs from a barrier to the end of its last step plus the
wait for the generation still in flight (so a snapshot's background write and peer
transfer count in full), max over ranks. One warm-up segment per configuration (buffers
allocated, first snapshots) is not timed. Reported: seconds per step min / median / max
over rounds, and per round the overhead against the same round's no-snapshot segment; the
same for CPU seconds per step (both processes, every thread: the tier's background writes
and transfers included), which a machine shared with other work disturbs less than wall
time.

**Restore per tier**, on the same states (one step, snapshotted into memory and saved
durably), both ranks restoring every time (equal reader counts), each restore with a new
``Checkpointer`` (as a restarted process has: buffers allocated by that restore; its
construction is not timed), interleaved in rotating order, ``--restore-reps`` repetitions:
- ``local-memory``: each rank reads its own node's copy;
- ``peer-memory``: node-1's memory is moved aside (node-1 lost its RAM): rank 1 fetches its
  state from node-0, which holds its peer copy, rank 0 reads its own;
- ``durable``: both nodes' memory moved aside; the checkpoint's files flushed and dropped
  from the page cache first (fsync + ``POSIX_FADV_DONTNEED``: a spare reads from storage);
- ``durable_warm``, for reference: the same with the files in the page cache.
Each restore is checked: its event's tier, and every weight equal to the saved ones (the
weights are disturbed before each restore). Bytes moved: the restore events' ``bytes_local``
and ``bytes_peer``, and the durable checkpoint's file bytes.

Writes JSON to bench/results/memory_tier.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checkpoint_restore import max_over_ranks  # noqa: E402
from _memory_tier_restore import bench_restore, rotate, spread, sum_over_ranks  # noqa: E402

WORK = os.path.join(HERE, ".work", "memory_tier")
OUT = os.path.join(HERE, "results", "memory_tier.json")
MEMORY_ROOT = os.path.join("/dev/shm", "steadytrain-bench-memory-tier")


class Job:
    """This rank's model, optimizer and batches; ``step()`` is one training step."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from steadytrain.train.model import GPT, GPTConfig

        cfg = GPTConfig(
            vocab_size=257,
            seq_len=args.seq,
            n_layer=args.layers,
            n_head=6,
            n_embd=args.embd,
        )
        self.model = DDP(GPT(cfg, seed=1))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(100 + rank)
        self.batches = [
            torch.randint(0, 257, (args.batch, args.seq), generator=gen) for _ in range(8)
        ]
        self.states = {"model": self.model, "optim": self.optim}
        self.i = 0

    def step(self) -> None:
        x = self.batches[self.i % len(self.batches)]
        self.i += 1
        _, loss = self.model(x, x)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        from steadytrain.checkpoint import state as S

        def walk(obj) -> int:
            import torch

            if isinstance(obj, torch.Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, dict):
                return sum(walk(v) for v in obj.values())
            if isinstance(obj, (list, tuple)):
                return sum(walk(v) for v in obj)
            return 0

        return walk(S.dcp_state_dict(self.states))

    def disturb(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.model.module.parameters():
                p.add_(1.0)


def _checkpointer(directory: str, every: int, events: list):
    from steadytrain.checkpoint import Checkpointer
    from steadytrain.checkpoint.config import CheckpointerConfig
    from steadytrain.checkpoint.memory.config import MemoryConfig

    cfg = CheckpointerConfig(
        async_mode="thread",
        keep_last=2,
        job_id="bench-memory-tier",
        memory=MemoryConfig(every_steps=every),
    )
    return Checkpointer(directory, on_event=events.append, config=cfg)


def bench_steps(args: argparse.Namespace, job: Job, rank: int) -> dict:
    """Seconds per step with no snapshots and with a snapshot every K steps, interleaved."""
    import torch.distributed as dist

    names = ["none", *(f"K={k}" for k in args.ks)]
    events: dict[str, list] = {n: [] for n in names}
    ckpts = {
        n: _checkpointer(os.path.join(args.work, "steps", n), int(n[2:]), events[n])
        for n in names
        if n != "none"
    }
    counters = dict.fromkeys(names, 0)

    def segment(name: str, steps: int) -> tuple[float, float]:
        """(wall seconds per step, max over ranks; CPU seconds per step, summed over
        ranks: every thread of both processes, the tier's writes and transfers too)."""
        ck = ckpts.get(name)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            job.step()
            counters[name] += 1
            if ck is not None:
                ck.maybe_save(counters[name], job.states)
        if ck is not None:
            ck.wait()  # the generation in flight counts: its write and transfer ran here
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return max_over_ranks(dist, wall) / steps, sum_over_ranks(dist, cpu) / steps

    for name in names:  # warm-up: buffers, first snapshots, DDP buckets
        segment(name, max(args.ks))
    for n in names:
        events[n].clear()
    per_step: dict[str, list[float]] = {n: [] for n in names}
    cpu_step: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for rnd in range(args.rounds):
        order = rotate(names, rnd)
        orders.append(order)
        for name in order:
            wall, cpu = segment(name, args.steps)
            per_step[name].append(wall)
            cpu_step[name].append(cpu)
        if rank == 0:
            print(
                f"round {rnd + 1}/{args.rounds}: "
                + ", ".join(
                    f"{n} {per_step[n][-1]:.3f} s ({cpu_step[n][-1]:.3f} cpu)" for n in names
                ),
                flush=True,
            )
    snaps = {}
    for name, ck in ckpts.items():
        ck.wait()
        recs = [e for e in events[name] if e.get("type") == "memory_snapshot"]
        bad = [e for e in recs if not e.get("ok")]
        assert not bad, bad[:1]
        mine = {
            k: statistics.median(float(e[k]) for e in recs) if recs else None
            for k in ("block_s", "write_s", "peer_s", "bytes", "peer_bytes")
        }
        mine["count"] = len(recs)
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
        snaps[name] = {"per_rank_medians": got}
        root = ck.memory.store.root if ck.memory is not None else None
        ck.close()
        if root:
            shutil.rmtree(root, ignore_errors=True)
    out: dict = {"steps_per_segment": args.steps, "rounds": args.rounds, "order": orders}
    for name in names:
        out[name] = {
            "s_per_step": spread(per_step[name]),
            "all_s_per_step": per_step[name],
            "cpu_s_per_step": spread(cpu_step[name]),
            "all_cpu_s_per_step": cpu_step[name],
        }
        if name != "none":
            for key, xs in (("", per_step), ("cpu_", cpu_step)):
                ratios = [k / b - 1 for k, b in zip(xs[name], xs["none"], strict=True)]
                out[name][f"{key}overhead_per_round"] = ratios
                out[name][f"{key}overhead"] = spread(ratios)
                out[name][f"{key}overhead_of_medians"] = (
                    statistics.median(xs[name]) / statistics.median(xs["none"]) - 1
                )
            out[name]["snapshots"] = snaps[name]
    return out


def run_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(args.work, ignore_errors=True)
        os.makedirs(args.work)
    dist.barrier()
    load_start = os.getloadavg()
    job = Job(args, rank)
    state_bytes = job.state_bytes()
    steps = bench_steps(args, job, rank)
    base = os.path.join(args.work, "restore")
    restore = bench_restore(
        lambda events: _checkpointer(base, 1, events), base, job, rank, args.restore_reps
    )
    dist.barrier()
    if rank == 0:
        ks = [f"K={k}" for k in args.ks]
        chosen = next((k for k in ks if steps[k]["overhead"]["median"] <= 0.02), None)
        chosen_cpu = next((k for k in ks if steps[k]["cpu_overhead"]["median"] <= 0.02), None)
        doc = {
            "benchmark": "memory_tier",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {"cpus": os.cpu_count(), "torch": torch.__version__},
            "command": " ".join(["bench/memory_tier.py", *sys.argv[1:]]),
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "setup": {
                "ranks": dist.get_world_size(),
                "nodes": "2 simulated nodes on one machine: rank r has STEADYTRAIN_NODE=node-r "
                "and STEADYTRAIN_MEMORY_DIR under /dev/shm; peer copies cross loopback TCP "
                "on the tier's own gloo group",
                "model": {
                    "layers": args.layers,
                    "embd": args.embd,
                    "seq": args.seq,
                    "batch": args.batch,
                    "optimizer": "AdamW",
                    "parallel": "DDP",
                },
                "state_bytes_per_rank": state_bytes,
                "threads_per_rank": 1,
            },  # fmt: skip
            "step_overhead": steps,
            "restore": restore,
            "targets": {
                "peer_restore_5x_faster_than_durable": restore["ratio_durable_vs_peer"] >= 5,
                "ratio_durable_vs_peer": restore["ratio_durable_vs_peer"],
                "overhead_median_per_k": {k: steps[k]["overhead"]["median"] for k in ks},
                "cpu_overhead_median_per_k": {k: steps[k]["cpu_overhead"]["median"] for k in ks},
                "smallest_k_within_2pct": chosen,
                "smallest_k_within_2pct_cpu": chosen_cpu,
            },
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(json.dumps(doc["targets"], indent=1))
        print(f"wrote {args.out}")
        shutil.rmtree(args.work, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5, 10])
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds (rotating order)")
    ap.add_argument("--steps", type=int, default=20, help="steps per segment")
    ap.add_argument("--restore-reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--memory-root", default=MEMORY_ROOT, help="the nodes' memory (RAM)")
    ap.add_argument("--work", default=WORK, help="where the checkpoints go (a local disk)")
    ap.add_argument("--out", default=OUT, help="where the JSON goes")
    args = ap.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shutil.rmtree(args.memory_root, ignore_errors=True)
    procs = []
    for r in range(2):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            STEADYTRAIN_NODE=f"node-{r}",
            STEADYTRAIN_MEMORY_DIR=os.path.join(args.memory_root, f"node-{r}"),
        )
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    try:
        return max(p.wait() for p in procs)
    finally:
        shutil.rmtree(args.memory_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
