"""What does the checkpoint memory tier cost a step, and how fast does each tier restore?

    .venv/bin/python bench/memory_tier.py                      # ≈ 15 min on 2 cores
    .venv/bin/python bench/memory_tier.py --rounds 2 --steps 10 --restore-reps 3  # quick

One run, 2 ranks on CPU (gloo), each on its own simulated node: rank r runs with
``STEADYTRAIN_NODE=node-r`` and ``STEADYTRAIN_MEMORY_DIR=<memory root>/node-r`` (a directory
of /dev/shm: RAM), so each rank's peer copy goes to the other "node" over loopback TCP on
the tier's own gloo group, as it would between machines (at loopback's speed, not a
network's). The job trains a GPT (``steadytrain.train.model``: 6 layers, d=384, 4 x 256
tokens a step; about 0.7 s a step on one core) under DDP with AdamW: 130 MB of state per
rank (weights and both moments).

**Step overhead**: the same training steps with no memory tier and with snapshots every K
steps (``--ks``, default 1 and 10; no durable saves), each K its own ``Checkpointer`` made
once, and ``auto``: ``every_steps = "auto"`` at ``--mtbf-s`` (default Llama 3 405B's failure
rate), the K the planner chose from the tier's own measurements in the warm-up. Every
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
- ``durable_warm``, for reference: the same with the files in the page cache;
- ``durable-remote`` (unless ``--no-remote``): a spare with no memory and no local disk
  copy restores from the object store: every durable checkpoint is also copied to a
  SeaweedFS server this bench starts on 127.0.0.1 (``checkpoint.remote``), and the node's
  local copy is moved aside (the restore downloads, verifies and loads it).
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
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _checkpoint_restore import max_over_ranks  # noqa: E402
from _memory_tier_restore import (  # noqa: E402
    bench_restore,
    rotate,
    spawn_nodes,
    spread,
    sum_over_ranks,
)

WORK = os.path.join(HERE, ".work", "memory_tier")
OUT = os.path.join(HERE, "results", "memory_tier.json")
MEMORY_ROOT = os.path.join("/dev/shm", "steadytrain-bench-memory-tier")
LLAMA3_MTBF_S = 54 * 86400 / 419  # Llama 3 405B: 419 unexpected interruptions in 54 days


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


def _remote() -> tuple[str | None, dict | None]:
    """The object store the launcher started (``--remote``), as every rank reaches it."""
    endpoint = os.environ.get("BENCH_S3_ENDPOINT")
    if not endpoint:
        return None, None
    opts = {
        "key": os.environ["BENCH_S3_KEY"],
        "secret": os.environ["BENCH_S3_SECRET"],
        "client_kwargs": {"endpoint_url": endpoint},
    }
    return "s3://bench/memory-tier", opts


def _checkpointer(directory: str, every, events: list, mtbf_s: float = 0.0, remote=False):
    from steadytrain.checkpoint import Checkpointer
    from steadytrain.checkpoint.config import CheckpointerConfig
    from steadytrain.checkpoint.memory.config import MemoryConfig

    url, opts = _remote() if remote else (None, None)
    cfg = CheckpointerConfig(
        async_mode="thread",
        keep_last=2,
        job_id="bench-memory-tier",
        memory=MemoryConfig(every_steps=every),
        mtbf_s=mtbf_s,
        remote=url or "",
        storage_options=opts or {},
    )
    return Checkpointer(directory, on_event=events.append, config=cfg)


def choose_auto(args: argparse.Namespace, job: Job) -> dict:
    """``every_steps = "auto"`` at ``--mtbf-s``: the K the tier chooses from its own
    measurements (its first snapshots), and the numbers it chose from. Not a timed
    contender: at the K it picks here (over a hundred steps) a bench-length segment would
    hold no snapshot at all, and its "overhead" would measure nothing."""
    from steadytrain.checkpoint.memory.auto import GAP, WARM

    events: list = []
    ck = _checkpointer(os.path.join(args.work, "auto"), "auto", events, mtbf_s=args.mtbf_s)
    steps = WARM + GAP + 3  # warm-ups, the measured snapshot, GAP steps, the one that chooses
    for step in range(1, steps + 1):
        job.step()
        ck.maybe_save(step, job.states)
    ck.wait()
    [chose] = [e for e in events if "every_steps" in e]
    root = ck.memory.store.root if ck.memory is not None else None
    ck.close()
    if root:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "mtbf_s": args.mtbf_s,
        "chosen_every_steps": chose.get("every_steps"),
        "measured": chose.get("auto"),
        "steps_run": steps,
    }


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
        segment(name, max(3, *args.ks))
    for name in names[1:]:
        # A timed segment's first step is a snapshot step (steps % K == 0 at its start):
        # its generation lands while the segment's next steps run, as in a long run, and
        # the segment holds steps / K snapshots exactly.
        k = int(name[2:])
        counters[name] += (k - 1 - counters[name]) % k
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
        want = args.rounds * args.steps // int(name[2:])
        assert all(g["count"] == want for g in got), (name, want, got)
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
                # one snapshot's cost, in steps: the overhead times K (a segment of
                # ``steps`` steps holds steps / K snapshots)
                out[name][f"{key}snapshot_cost_steps"] = spread([r * int(name[2:]) for r in ratios])
            out[name]["snapshots"] = snaps[name]
    return out


def at_chosen_k(steps: dict, auto: dict, ks: list[int]) -> dict | None:
    """The overhead at the K "auto" chose, from the measured cost of one snapshot at the
    largest timed K (its generations land well before the next): cost / K_auto, per round.
    Derived, not timed: see ``choose_auto``."""
    k_auto = auto.get("chosen_every_steps")
    if not k_auto:
        return None
    base = f"K={max(ks)}"
    out = {"every_steps": k_auto, "from": base, "derived": True}
    for key in ("", "cpu_"):
        per_round = [r * max(ks) / k_auto for r in steps[base][f"{key}overhead_per_round"]]
        out[f"{key}overhead"] = spread(per_round)
        out[f"{key}overhead_per_round"] = per_round
    measured = auto.get("measured") or {}
    if measured.get("step_s"):
        out["planner_predicted_overhead"] = measured["cost_s"] / (k_auto * measured["step_s"])
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
    auto = choose_auto(args, job) if args.mtbf_s > 0 else {}
    steps = bench_steps(args, job, rank)
    base = os.path.join(args.work, "restore")
    remote = _remote()[0] is not None
    restore = bench_restore(
        lambda events, directory=base: _checkpointer(directory, 1, events, remote=remote),
        base,
        job,
        rank,
        args.restore_reps,
        remote=remote,
    )
    dist.barrier()
    if rank == 0:
        ks = [f"K={k}" for k in args.ks]
        derived = at_chosen_k(steps, auto, args.ks)
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
            "auto": {**auto, "at_chosen_k": derived},
            "restore": restore,
            "targets": {
                "peer_restore_5x_faster_than_durable": restore["ratio_durable_vs_peer"] >= 5,
                "ratio_durable_vs_peer": restore["ratio_durable_vs_peer"],
                "peer_restore_5x_faster_than_durable_remote": (
                    restore.get("ratio_durable_remote_vs_peer", 0) >= 5
                ),
                "ratio_durable_remote_vs_peer": restore.get("ratio_durable_remote_vs_peer"),
                "auto_every_steps": auto.get("chosen_every_steps"),
                "auto_overhead_median_derived": derived and derived["overhead"]["median"],
                "auto_overhead_within_2pct_derived": bool(
                    derived and derived["overhead"]["median"] <= 0.02
                ),
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
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10])
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds (rotating order)")
    ap.add_argument(
        "--steps", type=int, default=10, help="steps per segment (a multiple of every K)"
    )
    ap.add_argument("--restore-reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--memory-root", default=MEMORY_ROOT, help="the nodes' memory (RAM)")
    ap.add_argument("--work", default=WORK, help="where the checkpoints go (a local disk)")
    ap.add_argument("--out", default=OUT, help="where the JSON goes")
    ap.add_argument(
        "--mtbf-s",
        type=float,
        default=LLAMA3_MTBF_S,
        help="the failure rate the 'auto' contender's planner assumes (default: Llama 3 "
        "405B's, 419 interruptions in 54 days; 0: no 'auto' contender)",
    )
    ap.add_argument(
        "--no-remote",
        dest="remote",
        action="store_false",
        help="no object store: skip the durable-remote restore (needs the `weed` binary)",
    )
    args = ap.parse_args()
    if any(args.steps % k for k in args.ks):
        ap.error(f"--steps {args.steps} is not a multiple of every K in --ks {args.ks}")
    if "RANK" in os.environ:
        run_rank(args)
        return 0
    server = start_store(args.work) if args.remote else None
    shutil.rmtree(args.memory_root, ignore_errors=True)
    procs = spawn_nodes(__file__, args.memory_root)
    try:
        return max(p.wait() for p in procs)
    finally:
        shutil.rmtree(args.memory_root, ignore_errors=True)
        stop_store(server)


def start_store(work: str):
    """A SeaweedFS server on 127.0.0.1 with a bucket ``bench``, announced to the ranks
    through the environment (``_remote``)."""
    from steadytrain.testing.s3_server import SeaweedServer

    shutil.rmtree(work + "-seaweed", ignore_errors=True)
    server = SeaweedServer(work + "-seaweed")
    os.makedirs(server.data_dir, exist_ok=True)
    server.start()
    server.make_bucket("bench")
    os.environ.update(
        BENCH_S3_ENDPOINT=server.endpoint,
        BENCH_S3_KEY=server.access_key,
        BENCH_S3_SECRET=server.secret_key,
    )
    return server


def stop_store(server) -> None:
    if server is not None:
        server.kill()
        shutil.rmtree(server.data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
