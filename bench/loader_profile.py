"""Where TokenLoader's in-process time goes, against the floor: cProfile of 3,000
micro-batches (seq 2048, micro-batch 8, global shuffle, ``prefetch=0``) over the loader
benchmark's 32 Mi-token dataset (``bench/loader_throughput.py`` makes it).

    .venv/bin/python bench/loader_profile.py   # prints the top functions by own time

Profiles are shares of one process's time, so they hold on a busy machine where absolute
timings do not; BENCHMARKS.md ("Data: loader") cites them.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

SEQ, MICRO, N = 2048, 8, 3000


def main() -> None:
    from _loader_common import make_dataset
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.loader import TokenLoader

    ds = TokenDataset.open(make_dataset("tp32m", 32 << 20))
    loader = TokenLoader(
        ds, SEQ, MICRO * 64, MICRO, seed=0, shuffle="global", num_workers=0, prefetch=0
    )
    for _ in range(200):  # warm: maps touched, first chunk planned
        next(loader)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for _ in range(N):
        next(loader)
    pr.disable()
    print(f"{(time.perf_counter() - t) / N * 1e6:.1f} us per micro-batch under the profiler")
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
