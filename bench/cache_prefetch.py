"""Benchmark: training over a slow link to object storage, with and without the node cache.

A real SeaweedFS server on 127.0.0.1 sits behind ``SlowLink`` (a loopback TCP proxy that
adds latency and caps bandwidth). A "training step" is a fixed simulated compute time
(``time.sleep``); the loop measures how long it waits for each step's data. One run, four
ways of feeding the same step sequence (``shuffle="sequential"``, so a step reads one
contiguous run of samples):

1. ``direct``: stream from the store without a cache: each step issues ranged GETs for
   exactly the bytes it needs, when it needs them, synchronously. This is a floor that shows
   the link's latency, *not* a fair baseline: a streaming loader reads ahead. The fair
   comparison (read-ahead streaming, mosaic streaming's and litdata's caches, several ranks
   per node, two epochs, an eviction) is ``bench/cache_peers.py``;
2. ``cache_on_demand``: ``TokenDataset`` over ``s3://`` with a ``ShardCache``, no prefetch:
   a shard is fetched when first touched;
3. ``cache_prefetch``: the same plus ``Prefetcher.for_loader`` (schedule-aware, horizon H);
4. ``staged``: ``stage`` the step range into a fresh cache first, then run: it must make
   zero remote reads.

Targets: in steady state ``cache_prefetch`` waits < 2 % of step time whenever the link's
bandwidth exceeds consumption; ``staged`` makes zero remote reads during the run.

    .venv/bin/python bench/cache_prefetch.py [--steps 200] [--step-ms 50] [--link-mbps 20]

Writes bench/results/cache_prefetch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "cache_prefetch.json")
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from steadytrain.data.ingest.writer import DatasetWriter  # noqa: E402
from steadytrain.data.read.dataset import TokenDataset  # noqa: E402
from steadytrain.data.read.loader import TokenLoader  # noqa: E402
from steadytrain.data.read.sampler import Sampler  # noqa: E402
from steadytrain.data.read.schedule import schedule_for_run  # noqa: E402
from steadytrain.storage.prefetch import Prefetcher  # noqa: E402
from steadytrain.storage.stage import stage  # noqa: E402
from steadytrain.storage.store import Store  # noqa: E402
from steadytrain.testing.s3_server import SeaweedServer  # noqa: E402


def summarise(waits: list[float], steps: list[float], warmup: int) -> dict:
    w, s = np.array(waits[warmup:]), np.array(steps[warmup:])
    return {
        "steps_measured": int(w.size),
        "warmup_steps": warmup,
        "data_wait_mean_s": float(w.mean()),
        "data_wait_p50_s": float(np.percentile(w, 50)),
        "data_wait_p99_s": float(np.percentile(w, 99)),
        "data_wait_max_s": float(w.max()),
        "step_mean_s": float(s.mean()),
        "data_wait_share": float(w.sum() / s.sum()),
        "first_steps_wait_s": float(np.sum(waits[:warmup])),
    }


def run_loader(loader, steps: int, compute_s: float, on_step=None) -> tuple[list, list]:
    waits, walls = [], []
    micro = loader.micro_per_step
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(micro):
            next(loader)
        t1 = time.perf_counter()
        time.sleep(compute_s)  # the accelerator computing
        waits.append(t1 - t0)
        walls.append(time.perf_counter() - t0)
    return waits, walls


def run_direct(store: Store, ds_manifest, args, compute_s: float) -> tuple[list, list, dict]:
    """Cache-less streaming: per step, ranged GETs for exactly the samples' bytes."""
    ds = TokenDataset(store.url, ds_manifest, cache_dir="/nonexistent-unused")
    sampler = Sampler([ds], args.seq_len, args.global_batch, mode="sequential")
    item = np.dtype(ds_manifest.dtype).itemsize
    waits, walls = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        refs = sampler.locate(sampler.positions_of_step(step))
        for shard in np.unique(refs.shard):
            offs = refs.offset[refs.shard == shard]
            lo, hi = int(offs.min()), int(offs.max()) + args.seq_len + 1
            name = ds_manifest.shards[int(shard)].name
            data = store.read_bytes(name, lo * item, hi * item)
            assert len(data) == (hi - lo) * item
        t1 = time.perf_counter()
        time.sleep(compute_s)
        waits.append(t1 - t0)
        walls.append(time.perf_counter() - t0)
    return waits, walls, dict(store.stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=50.0, help="simulated compute per step")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--shard-mib", type=int, default=8)
    ap.add_argument("--link-mbps", type=float, default=20.0, help="link bandwidth, MB/s")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way link latency")
    ap.add_argument("--horizon", type=int, default=48, help="prefetch horizon in steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from steady state")
    ap.add_argument(
        "--loader-prefetch", type=int, default=8, help="TokenLoader prefetch (micro-batches)"
    )
    args = ap.parse_args()
    compute_s = args.step_ms / 1000
    bytes_per_step = args.global_batch * (args.seq_len + 1) * 2
    consumption = bytes_per_step / compute_s
    shard_tokens = args.shard_mib << 19  # uint16 tokens
    n_tokens = (args.steps + args.horizon + 8) * args.global_batch * args.seq_len + shard_tokens
    tmp = tempfile.mkdtemp(prefix="bench-cache-")
    server = SeaweedServer(os.path.join(tmp, "seaweed"))
    os.makedirs(server.data_dir, exist_ok=True)
    server.start()
    link = None
    try:
        server.make_bucket("bench")
        url = "s3://bench/ds"
        t0 = time.perf_counter()
        rng = np.random.default_rng(0)
        with DatasetWriter(
            Store(url, server.storage_options),
            vocab_size=50000,
            eos_id=0,
            tokenizer={},
            shard_tokens=shard_tokens,
        ) as w:
            left = n_tokens
            while left > 0:
                n = min(left, 1 << 18)
                w.add_document(np.append(rng.integers(1, 50000, size=n - 1), 0))
                left -= n
        upload_s = time.perf_counter() - t0
        # The link runs in its own process: the network is not the trainer's CPU time.
        link = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "steadytrain.testing.slowlink",
                str(server.ports["s3.port"]),
                str(args.latency_ms),
                str(args.link_mbps),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        endpoint = f"http://127.0.0.1:{int(link.stdout.readline())}"
        opts = {**server.storage_options, "client_kwargs": {"endpoint_url": endpoint}}
        results: dict = {}

        def fresh(cache_name: str) -> TokenDataset:
            return TokenDataset.open(
                url, cache_dir=os.path.join(tmp, cache_name), storage_options=opts
            )

        loader_kw = dict(
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            micro_batch=args.global_batch // 2,
            shuffle="sequential",
            prefetch=args.loader_prefetch,
        )

        # 1. direct streaming
        store = Store(url, opts)
        ds0 = fresh("unused")
        waits, walls, stats = run_direct(store, ds0.manifest, args, compute_s)
        results["direct"] = {
            **summarise(waits, walls, args.warmup),
            "remote_requests": stats["requests"],
            "remote_bytes": stats["bytes_read"],
        }
        print("direct", json.dumps(results["direct"]), flush=True)

        # 2. cache, demand fetch only; 3. cache with schedule-aware prefetch
        for mode in ("cache_on_demand", "cache_prefetch"):
            ds = fresh(mode)
            loader = TokenLoader(ds, **loader_kw)
            pf = (
                Prefetcher.for_loader(loader, horizon_steps=args.horizon, workers=2)
                if mode == "cache_prefetch"
                else None
            )
            before = dict(ds.store.stats)
            waits, walls = run_loader(loader, args.steps, compute_s)
            m = ds.cache.metrics()
            if pf is not None:
                pf.close()
            loader.close()
            results[mode] = {
                **summarise(waits, walls, args.warmup),
                "remote_requests": ds.store.stats["requests"] - before["requests"],
                "remote_bytes": ds.store.stats["bytes_read"] - before["bytes_read"],
                "cache": m,
                "waits_ms": [round(x * 1000, 3) for x in waits],
            }
            print(
                mode,
                json.dumps(
                    {k: v for k, v in results[mode].items() if k not in ("cache", "waits_ms")}
                ),
                flush=True,
            )

        # 4. stage the run's step range into a fresh cache, then train from it
        ds = fresh("staged")
        sched = schedule_for_run(
            ds, seq_len=args.seq_len, global_batch=args.global_batch, shuffle="sequential"
        )
        # The run's range plus what the loader reads ahead of the last step.
        rep = stage(
            ds.cache, schedule=sched, steps=(0, args.steps + args.loader_prefetch), workers=4
        )
        loader = TokenLoader(ds, **loader_kw)
        before = dict(ds.store.stats)
        waits, walls = run_loader(loader, args.steps, compute_s)
        loader.close()
        results["staged"] = {
            **summarise(waits, walls, args.warmup),
            "stage": {k: rep[k] for k in ("shards", "bytes", "bytes_fetched", "seconds", "gbps")},
            "remote_requests": ds.store.stats["requests"] - before["requests"],
            "remote_bytes": ds.store.stats["bytes_read"] - before["bytes_read"],
            "cache_downloads": ds.cache.metrics()["downloads"],
        }
        print("staged", json.dumps(results["staged"]), flush=True)
    finally:
        if link is not None:
            link.stdin.close()
            link.wait(timeout=10)
        server.kill()

    pre = results["cache_prefetch"]
    out = {
        "benchmark": "cache_prefetch",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            **vars(args),
            "bytes_per_step": bytes_per_step,
            "consumption_MBps": consumption / 1e6,
            "link_over_consumption": args.link_mbps * 1e6 / consumption,
            "dataset_bytes": n_tokens * 2,
            "upload_s": upload_s,
        },
        "results": results,
        "targets": {
            "prefetch_wait_share_lt_2pct": pre["data_wait_share"] < 0.02,
            "staged_zero_remote_reads": results["staged"]["remote_requests"] == 0,
        },
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=2, sort_keys=True, default=str)
    print(json.dumps(out["targets"]))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
