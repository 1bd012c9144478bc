"""Loader memory does not grow with steps: RSS at step 32,000 vs step 3,000,000.

The sizes of the incident run: 11T tokens (a sparse, zero-disk dataset of 11,000 shards of
1B tokens), global batch 576, seq 4096; the loader is rank 0 of 8 (72 samples per step in
micro-batches of 8). Each configuration runs in a fresh process: open the dataset, build
the loader, restore it at the step, read 5 steps, then measure resident memory (the process
and its worker processes). The peer that materialises an index, Megatron-core's GPTDataset
(its mock low-level dataset, the same index builder as on real data), is built for
``steps * 576`` samples at steps 3,200 / 32,000 / 100,000; 3,000,000 steps would need
~1.7e9 samples of index (measured bytes/sample x samples, reported as an extrapolation).

    .venv/bin/python bench/loader_memory.py   -> bench/results/loader_memory.json
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _loader_common import (  # noqa: E402
    PEER_PY,
    STUB_DIR,
    WORK,
    ensure_peer_env,
    make_sparse_11t,
    run_json,
    write_result,
)

SEQ, G, WORLD, MICRO = 4096, 576, 8, 8


def rss_tree() -> dict[str, int]:
    """Resident memory of this process and its workers, split as /proc reports it:
    anonymous (the loader's own heap), file (mapped shard pages: page cache), shmem."""
    import psutil

    pids = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
    out = {"rss_bytes": 0, "rss_anon_bytes": 0, "rss_file_bytes": 0, "rss_shmem_bytes": 0}
    keys = {
        "VmRSS": "rss_bytes",
        "RssAnon": "rss_anon_bytes",
        "RssFile": "rss_file_bytes",
        "RssShmem": "rss_shmem_bytes",
    }
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in keys:
                        out[keys[name]] += int(value.split()[0]) * 1024
        except FileNotFoundError:
            pass
    return out


def child(data: str, step: int, workers: int) -> dict:
    import gc

    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.loader import TokenLoader

    ds = TokenDataset.open(data)
    loader = TokenLoader(ds, SEQ, G, MICRO, rank=0, world_size=WORLD, seed=0, num_workers=workers)
    state = loader.state_dict()
    state.update(step=step, position=step * G)
    t0 = time.perf_counter()
    loader.load_state_dict(state)
    for _ in range(5 * loader.micro_per_step):
        next(loader)
    elapsed = time.perf_counter() - t0
    gc.collect()
    time.sleep(0.2)
    # Return freed heap pages to the OS first: otherwise RSS also counts how glibc happened
    # to keep freed 512 KiB batch buffers, which varies run to run by several MiB.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    mem = rss_tree()
    sd = loader.state_dict()
    loader.close()
    return {
        "step": step,
        "workers": workers,
        **mem,
        "state_json_bytes": len(json.dumps(sd)),
        "restore_and_5_steps_s": elapsed,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    t_start = time.time()
    data = make_sparse_11t()
    rows = []
    for workers in (0, 2):
        for step in (32_000, 3_000_000):
            rows.append(
                run_json([sys.executable, __file__, "--child", data, str(step), str(workers)], 300)
            )
    ours = {}
    for workers in (0, 2):
        a, b = [r for r in rows if r.get("workers") == workers]
        ours[f"workers={workers}"] = {
            "rss_diff_bytes": b["rss_bytes"] - a["rss_bytes"],
            "rss_anon_diff_bytes": b["rss_anon_bytes"] - a["rss_anon_bytes"],
            "rss_shmem_diff_bytes": b["rss_shmem_bytes"] - a["rss_shmem_bytes"],
            "rss_32k": a["rss_bytes"],
            "rss_3M": b["rss_bytes"],
            "anon_32k": a["rss_anon_bytes"],
            "anon_3M": b["rss_anon_bytes"],
        }
    py, note = ensure_peer_env()
    peer_rows = []
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "loader_peers.py")
    for steps in (3_200, 32_000, 100_000):
        if py is None:
            peer_rows.append({"steps": steps, "error": note})
            continue
        r = run_json(
            [
                PEER_PY,
                script,
                "megatron-memory",
                "--steps",
                str(steps),
                "--global-batch",
                str(G),
                "--seq",
                str(SEQ),
                "--work",
                os.path.join(WORK, "peers"),
            ],
            300,
            env={"PYTHONPATH": STUB_DIR},
        )
        r["steps"] = steps
        peer_rows.append(r)
    good = [r for r in peer_rows if "error" not in r]
    extrapolation = None
    if len(good) >= 2:
        lo, hi = good[0], good[-1]
        per_sample = (hi["rss_bytes"] - lo["rss_bytes"]) / (hi["num_samples"] - lo["num_samples"])
        extrapolation = {
            "rss_bytes_per_sample": per_sample,
            "rss_diff_32k_to_3M_bytes_extrapolated": per_sample * (3_000_000 - 32_000) * G,
        }
    path = write_result(
        "loader_memory",
        {
            "seq_len": SEQ,
            "global_batch": G,
            "world_size": WORLD,
            "dataset": "11T tokens, 11,000 shards",
            "ours": rows,
            "ours_summary": ours,
            "megatron": peer_rows,
            "megatron_extrapolation": extrapolation,
            "wall_s": time.time() - t_start,
        },
    )
    for name, s in ours.items():
        print(
            f"steadytrain {name}: RSS {s['rss_32k'] / 2**20:.1f} MiB at step 32,000, "
            f"{s['rss_3M'] / 2**20:.1f} MiB at 3,000,000: diff {s['rss_diff_bytes'] / 2**20:+.2f} "
            f"MiB (anonymous {s['anon_32k'] / 2**20:.1f} -> {s['anon_3M'] / 2**20:.1f} MiB: "
            f"{s['rss_anon_diff_bytes'] / 2**20:+.2f}; shmem {s['rss_shmem_diff_bytes'] / 2**20:+.2f})"
        )
    for r in peer_rows:
        if "error" in r:
            print(f"megatron steps={r['steps']}: {r['error']}")
        else:
            print(
                f"megatron GPTDataset steps={r['steps']:>7d} ({r['num_samples']:.2e} samples): RSS "
                f"{r['rss_bytes'] / 2**20:.0f} MiB, index {r['index_bytes'] / 2**20:.0f} MiB, "
                f"build {r['build_s']:.1f} s"
            )
    if extrapolation:
        print(
            f"megatron extrapolated RSS growth 32,000 -> 3,000,000 steps: "
            f"{extrapolation['rss_diff_32k_to_3M_bytes_extrapolated'] / 2**30:.1f} GiB"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
