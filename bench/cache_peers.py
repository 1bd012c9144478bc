"""Benchmark: a node of R ranks training two epochs over a slow link, with a cache that must
evict: our node cache against read-ahead streaming and the peers' own caches.

A real SeaweedFS server on loopback sits behind ``SlowLink`` (a shared link with a bandwidth
cap and latency; its byte counter is the node's remote traffic, whoever reads). One node:
``--ranks`` processes in a gloo group, each taking its share of every global batch, a
simulated compute per step (``time.sleep``), then a barrier (the gradient all-reduce: the
node's step ends with its slowest rank). Two epochs over the same tokens in the same
sequential order, with a node cache budget of ``--budget-shards`` of the ``--shards``
shards: the cache fills during epoch 1 and every later shard needs an eviction first; the
head of epoch 2 needs what was evicted.

Contenders (each in fresh processes and a fresh cache, every round in a rotated order):

1. ``readahead``: no cache; plain ranged GETs for each rank's samples, issued ``--ahead``
   steps early on a thread pool (``bench/_cache_ranks.py``);
2. ``ours``: ``ShardCache`` shared by the node's ranks + schedule-aware ``Prefetcher`` with
   the training loop's defaults and ``cache_budget_bytes`` = the budget;
3. ``streaming``: mosaicml-streaming's ``StreamingDataset`` from ``s3://`` (MDS),
   ``cache_limit`` = the budget (``bench/peers/cache_peers.py``);
4. ``litdata``: litdata's ``StreamingDataset``/``StreamingDataLoader`` from ``s3://``
   (``optimize`` format), ``max_cache_size`` = the budget.

The peers run in bench/.env/peers (``ensure_peer_env``); one that cannot be installed or run
here is reported with its error, not imitated.

    .venv/bin/python bench/cache_peers.py [--rounds 3] [--ranks 2] [--budget-shards 6]

Writes bench/results/cache_peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from _loader_common import STUB_DIR, ensure_peer_env, write_result  # noqa: E402
from steadytrain.data.ingest.writer import DatasetWriter  # noqa: E402
from steadytrain.testing.s3_server import SeaweedServer, free_ports  # noqa: E402
from steadytrain.testing.slowlink import SlowLink  # noqa: E402

CONTENDERS = ("readahead", "ours", "streaming", "litdata")
PEERS = ("streaming", "litdata")


def make_tokens(root: str, shards: int, shard_tokens: int) -> None:
    rng = np.random.default_rng(0)
    with DatasetWriter(
        root, vocab_size=50257, eos_id=50256, tokenizer={"type": "bench"}, shard_tokens=shard_tokens
    ) as w:
        for _ in range(shards):
            toks = rng.integers(0, 50256, size=shard_tokens, dtype=np.uint16)
            toks[-1] = 50256
            w.add_documents(toks, np.array([shard_tokens]))


def run_node(a, contender: str, url: str, endpoint_port: int, server, tmp: str, tag: str) -> dict:
    """Start the node's ranks for one contender; their JSON lines and the link's bytes."""
    link = SlowLink(endpoint_port, latency_s=a.latency_ms / 1000, down_bps=a.link_mbps * 1e6)
    cache = os.path.join(tmp, "cache", tag)
    os.makedirs(cache)
    steps = 2 * a.steps_per_epoch
    if contender in PEERS:
        cmd = [a.peer_py, os.path.join(HERE, "peers", "cache_peers.py"), contender]
    else:
        cmd = [sys.executable, os.path.join(HERE, "_cache_ranks.py"), contender]
        cmd += ["--ahead", str(a.ahead)]
    cmd += ["--url", url, "--cache", cache, "--steps", str(steps), "--per-rank", str(a.per_rank)]
    cmd += ["--seq", str(a.seq), "--compute-ms", str(a.compute_ms)]
    cmd += ["--budget-bytes", str(a.budget_bytes), "--workers", str(a.peer_workers)]
    env = {
        **os.environ,
        **server.env(),
        "BENCH_ENDPOINT": link.endpoint,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_ports(1)[0]),
        "WORLD_SIZE": str(a.ranks),
        "LOCAL_WORLD_SIZE": str(a.ranks),
        "OMP_NUM_THREADS": "1",
    }
    if contender in PEERS:
        env["PYTHONPATH"] = STUB_DIR
    procs, logs = [], []
    t0 = time.perf_counter()
    for r in range(a.ranks):
        log = open(os.path.join(tmp, f"{tag}-rank{r}.log"), "w+")
        env_r = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_r))
        logs.append(log)
    ranks, error = [], None
    try:
        for p in procs:
            p.wait(timeout=max(1.0, a.timeout_s - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        error = f"timed out after {a.timeout_s:.0f} s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        link.close()
    for r, log in enumerate(logs):
        log.seek(0)
        text = log.read()
        log.close()
        lines = [ln for ln in text.splitlines() if ln.startswith('{"rank"')]
        if lines:
            ranks.append(json.loads(lines[-1]))
        elif error is None or "gloo" in error:  # a rank that lost its peer is not the cause
            # The exception line itself, not the tail of a long rich-formatted traceback.
            lines = text.strip().splitlines()
            raised = [ln for ln in lines if "Error: " in ln or "Exception: " in ln]
            error = f"rank {r} exit {procs[r].returncode}: {(raised or lines)[-1][-900:]}"
            keep = os.path.join(HERE, ".work", "cache_peers_logs")
            os.makedirs(keep, exist_ok=True)
            shutil.copy(log.name, keep)
    shutil.rmtree(cache, ignore_errors=True)
    if error is not None:
        return {"error": error.replace(tmp, "<tmp>")}
    return {
        "wall_s": time.perf_counter() - t0,
        "remote_bytes": link.down.bytes,
        "link_connections": link.connections,
        **summarise(a, ranks),
    }


def summarise(a, ranks: list[dict]) -> dict:
    """Node-level figures: a step's data wait is its slowest rank's (the barrier)."""
    waits = np.max([r["waits"] for r in ranks], axis=0)
    walls = np.array(ranks[0]["walls"])
    starts = ranks[0]["epoch_starts"]
    e2 = starts[1] if len(starts) > 1 else len(waits)
    w = a.warmup_steps
    fill = a.fill_step  # from here on every new shard needs an eviction first
    head = slice(e2, min(len(waits), e2 + 2 * a.steps_per_shard))

    def share(sl: slice) -> float:
        return float(waits[sl].sum() / walls[sl].sum()) if walls[sl].size else float("nan")

    out = {
        "data_wait_share": share(slice(w, None)),
        "cold_start_wait_s": float(waits[:w].sum()),
        "epoch2_start_step": e2,
        "epoch2_wait_share": share(slice(e2, None)),
        "epoch2_wait_s": float(waits[e2:].sum()),
        "after_fill_wait_share": share(slice(fill, e2)),
        "epoch2_head_wait_s": float(waits[head].sum()),
        "epoch2_head_max_step_wait_s": float(waits[head].max()) if waits[head].size else None,
        "max_step_wait_s": float(waits[w:].max()),
        "step_mean_s": float(walls[w:].mean()),
        "samples": int(sum(r["samples"] for r in ranks)),
        "build_s_max": float(max(r["build_s"] for r in ranks)),
        "node_waits_ms": [round(float(x) * 1000, 1) for x in waits],
    }
    if "cache" in ranks[0]:
        out["ours_downloads"] = int(sum(r["cache"]["downloads"] for r in ranks))
        out["ours_evictions"] = sorted(tuple(e) for r in ranks for e in r["evictions_by_this_rank"])
        out["ours_prefetch_errors"] = int(sum(r["prefetch_errors"] for r in ranks))
    return out


def spread(rows: list[dict], key: str) -> dict | None:
    vals = [r[key] for r in rows if r.get(key) is not None and "error" not in r]
    if not vals:
        return None
    return {"min": min(vals), "median": float(np.median(vals)), "max": max(vals), "n": len(vals)}


def upload(server, local: str, remote: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    fs.put(local.rstrip("/") + "/", remote, recursive=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="ranks (processes) on the node")
    ap.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=4)
    ap.add_argument("--budget-shards", type=int, default=6, help="node cache budget, in shards")
    ap.add_argument("--compute-ms", type=float, default=25.0, help="simulated compute per step")
    ap.add_argument("--link-mbps", type=float, default=16.0, help="link bandwidth, MB/s")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way link latency")
    ap.add_argument("--ahead", type=int, default=4, help="readahead: steps issued early")
    ap.add_argument("--peer-workers", type=int, default=1, help="peers' DataLoader workers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=2, help="cold start, excluded")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per node run")
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, default=list(CONTENDERS))
    ap.add_argument("--out", default="cache_peers", help="results name under bench/results/")
    a = ap.parse_args()
    load_at_start = os.getloadavg()
    shard_tokens = a.shard_mib << 19
    g = a.ranks * a.per_rank
    samples = a.shards * ((shard_tokens - 1) // a.seq)
    a.steps_per_epoch = samples // g
    a.steps_per_shard = ((shard_tokens - 1) // a.seq) // g
    a.fill_step = a.budget_shards * a.steps_per_shard
    a.budget_bytes = a.budget_shards * (shard_tokens * 2 + 64)  # + a shard's small index file
    bytes_per_step = g * (a.seq + 1) * 2
    tmp = tempfile.mkdtemp(prefix="bench-cachepeers-")
    server = SeaweedServer(os.path.join(tmp, "seaweed"))
    os.makedirs(server.data_dir, exist_ok=True)
    notes: dict = {}
    contenders = list(a.only)
    rows: dict[str, list[dict]] = {c: [] for c in contenders}
    try:
        server.start()
        server.make_bucket("bench")
        local = os.path.join(tmp, "tokens")
        make_tokens(local, a.shards, shard_tokens)
        upload(server, local, "bench/ours")
        if any(c in PEERS for c in contenders):
            a.peer_py, notes["peer_env"] = ensure_peer_env()
            conv = os.path.join(tmp, "peerfmt")
            if a.peer_py is not None:
                cmd = [a.peer_py, os.path.join(HERE, "peers", "cache_peers.py"), "convert"]
                cmd += ["--data", local, "--out", conv, "--seq", str(a.seq)]
                cmd += ["--shard-bytes", str(shard_tokens * 2)]
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": STUB_DIR}
                )
                if proc.returncode != 0:
                    notes["convert_error"] = proc.stderr.strip().splitlines()[-3:]
                else:
                    notes["convert"] = json.loads(proc.stdout.strip().splitlines()[-1])
                    upload(server, os.path.join(conv, "mds"), "bench/mds")
                    upload(server, os.path.join(conv, "litdata"), "bench/litdata")
            for c in PEERS:
                if c in contenders and (a.peer_py is None or "convert_error" in notes):
                    err = notes.get("convert_error") or notes["peer_env"]
                    rows[c].append({"error": f"not run: {err}"})
                    contenders.remove(c)
        urls = {
            "readahead": "s3://bench/ours",
            "ours": "s3://bench/ours",
            "streaming": "s3://bench/mds",
            "litdata": "s3://bench/litdata",
        }
        for rnd in range(a.rounds):
            k = rnd % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                res = run_node(a, c, urls[c], server.ports["s3.port"], server, tmp, f"{c}-{rnd}")
                res["round"] = rnd
                rows[c].append(res)
                brief = {
                    k: v for k, v in res.items() if k not in ("ours_evictions", "node_waits_ms")
                }
                print(c, json.dumps(brief), flush=True)
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    keys = (
        "data_wait_share",
        "epoch2_wait_share",
        "after_fill_wait_share",
        "epoch2_head_wait_s",
        "max_step_wait_s",
        "cold_start_wait_s",
        "remote_bytes",
        "step_mean_s",
    )
    summary = {c: {k: spread(rows[c], k) for k in keys} for c in rows}
    for c in rows:
        errors = [r["error"] for r in rows[c] if "error" in r]
        if errors:
            summary[c]["errors"] = errors
    settings = {k: v for k, v in vars(a).items() if k not in ("peer_py", "out")}
    out = {
        "benchmark": "cache_peers",
        "command": "bench/cache_peers.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            **settings,
            "bytes_per_step": bytes_per_step,
            "consumption_MBps": bytes_per_step / (a.compute_ms / 1000) / 1e6,
            "dataset_bytes": a.shards * shard_tokens * 2,
            "load_average_at_start": load_at_start,
        },
        "notes": notes,
        "summary": summary,
        "rounds": rows,
    }
    print(json.dumps(summary, indent=1))
    print("wrote", write_result(a.out, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
