"""How fast can the object store hand back a checkpoint at best? The memory tier's baseline.

    .venv/bin/python bench/object_store_download.py            # ≈ 1 min

bench/memory_tier.py compares the peer-memory restore with steadytrain's own remote durable
restore, which downloads each file in one stream. That restore is not the best the store
can do, so this bench prices the store itself: the same SeaweedFS on 127.0.0.1 that
bench/memory_tier.py starts, one 130 MB object (the size of that bench's checkpoint), and
two processes (its two ranks) downloading it at once, as raw bytes (no checksum, no load):

- ``one stream``: one GET per process (what the shipped remote restore does per file);
- ``ranged N``: N concurrent range GETs per process (s3fs ``cat_ranges``), the way a
  parallel downloader (s5cmd, boto3's transfer manager, the AWS CRT) reads a large object;
- ``steadytrain``: ``Store.get_file`` as the remote durable restore calls it (ranged parts
  at its defaults, into a local file published whole, no fsync), the bytes also on disk.

Repetitions interleave the contenders in rotating order; the time of a repetition is the
slower process's. Writes JSON to bench/results/object_store_download.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
KEY = "bench/ckpt/__0_0.distcp"
WORK = "/tmp/steadytrain-bench-download"


def _download(opts: dict, parts: int, size: int) -> float:
    """One process's download of the object: ``parts`` ranged GETs (1: one GET), or
    steadytrain's ``Store.get_file`` when ``parts`` is 0."""
    import s3fs

    if parts == 0:
        from steadytrain.storage.store import Store

        store = Store("s3://" + KEY.split("/")[0], opts)
        dst = os.path.join(WORK, f"get-{os.getpid()}.bin")
        t = time.perf_counter()
        store.get_file(KEY.split("/", 1)[1], dst, durable=False)
        seconds = time.perf_counter() - t
        got = os.path.getsize(dst)
        os.unlink(dst)
        if got != size:
            raise RuntimeError(f"downloaded {got} of {size} bytes of {KEY}")
        return seconds
    fs = s3fs.S3FileSystem(**opts)
    step = -(-size // parts)
    starts = [i * step for i in range(parts)]
    t = time.perf_counter()
    if parts == 1:
        got = len(fs.cat_file(KEY))
    else:
        ends = [min(size, s + step) for s in starts]
        got = sum(map(len, fs.cat_ranges([KEY] * parts, starts, ends)))
    seconds = time.perf_counter() - t
    if got != size:
        raise RuntimeError(f"downloaded {got} of {size} bytes of {KEY}")
    return seconds


def _label(parts: int) -> str:
    return {0: "steadytrain", 1: "one stream"}.get(parts, f"ranged {parts}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=130, help="object size, MB (2**20 bytes)")
    ap.add_argument("--readers", type=int, default=2, help="processes downloading at once")
    ap.add_argument(
        "--parts", type=int, nargs="+", default=[1, 8, 16, 0], help="0: steadytrain's get_file"
    )
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "object_store_download.json"))
    args = ap.parse_args()

    import s3fs

    from memory_tier import start_store, stop_store

    size = args.mb << 20
    os.makedirs(WORK, exist_ok=True)
    server = start_store(WORK)
    times: dict[int, list[float]] = {p: [] for p in args.parts}
    try:
        s3fs.S3FileSystem(**server.storage_options).pipe_file(KEY, os.urandom(size))
        ctx = mp.get_context("spawn")  # s3fs's event loop does not survive a fork
        with ctx.Pool(args.readers) as pool:
            for rep in range(args.reps):
                k = rep % len(args.parts)
                for parts in args.parts[k:] + args.parts[:k]:
                    jobs = [(server.storage_options, parts, size)] * args.readers
                    times[parts].append(max(pool.starmap(_download, jobs)))
    finally:
        stop_store(server)

    def spread(v: list[float]) -> dict[str, float]:
        return {"min": min(v), "median": statistics.median(v), "max": max(v)}

    result = {
        "benchmark": "object_store_download",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "load_average_at_end": os.getloadavg(),
        "bytes": size,
        "readers": args.readers,
        "seconds": {_label(p): {**spread(v), "all": v} for p, v in times.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for p, v in times.items():
        s = spread(v)
        print(f"{_label(p):>12}: {s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} s")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
