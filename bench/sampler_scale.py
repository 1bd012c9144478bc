"""Sampler construction at the scale of an 11T-token run: under 1 s and 64 MiB.

A synthetic manifest (no files) of 11T tokens at seq 4096, in shards of 1B tokens (11,000
shards) and of 128 Mi tokens (~82,000 shards); each configuration runs in a fresh process
that builds the Manifest, then times ``Sampler(...)`` and measures the memory it adds
(tracemalloc peak and RSS growth), then maps the positions of step 3,000,000 (global batch
576) to show the first use needs nothing more.

    .venv/bin/python bench/sampler_scale.py   -> bench/results/sampler_scale.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _loader_common import write_result  # noqa: E402

TOTAL = 11 * 10**12
SEQ, G = 4096, 576


def child(shard_tokens: int, mode: str) -> dict:
    import gc
    import tracemalloc

    import psutil

    from steadytrain.data.read.format import Manifest, ShardInfo
    from steadytrain.data.read.sampler import Sampler

    n = TOTAL // shard_tokens
    shards = tuple(
        ShardInfo(
            f"shards/shard-{i:06d}.tokens",
            shard_tokens * 2,
            shard_tokens,
            1000,
            "xxh3_64:0",
            f"shards/shard-{i:06d}.idx",
            8000,
            "xxh3_64:0",
        )
        for i in range(n)
    )
    manifest = Manifest("uint16", 50257, 50256, {}, shards, "synthetic-11T")
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    tracemalloc.start()
    t0 = time.perf_counter()
    sampler = Sampler([manifest], SEQ, G, seed=0, mode=mode)
    build_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    refs = sampler.locate(sampler.positions_of_step(3_000_000))
    first_step_s = time.perf_counter() - t0
    return {
        "shards": n,
        "mode": mode,
        "samples": sampler.num_samples[0],
        "construct_s": build_s,
        "construct_peak_alloc_bytes": peak,
        "rss_growth_bytes": rss - rss0,
        "map_step_3M_s": first_step_s,
        "step_3M_first_shard": int(refs.shard[0]),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), sys.argv[3])))
        return
    rows = []
    for shard_tokens in (10**9, 1 << 27):
        for mode in ("global", "block", "sequential"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(shard_tokens), mode],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ok = all(r["construct_s"] < 1 and r["construct_peak_alloc_bytes"] < 64 << 20 for r in rows)
    path = write_result(
        "sampler_scale", {"tokens": TOTAL, "seq_len": SEQ, "rows": rows, "target_met": ok}
    )
    for r in rows:
        print(
            f"{r['shards']:>7d} shards {r['mode']:>10s}: construct {r['construct_s'] * 1e3:7.1f} ms, "
            f"peak alloc {r['construct_peak_alloc_bytes'] / 2**20:6.2f} MiB, RSS +"
            f"{r['rss_growth_bytes'] / 2**20:6.2f} MiB, map step 3M {r['map_step_3M_s'] * 1e3:.2f} ms"
        )
    print(f"target (< 1 s, < 64 MiB) met: {ok}; wrote {path}")


if __name__ == "__main__":
    main()
