"""Where TokenLoader's time goes, against the floor, in-process and in thread mode.

1. cProfile of 3,000 in-process micro-batches (seq 2048, micro-batch 8, global shuffle,
   ``prefetch=0``) over the loader benchmark's 32 Mi-token dataset (``bench/loader_throughput.py``
   makes it): the top functions by own time.
2. The thread hand-off, measured without a profiler (which would distort it): the default
   loader (``num_workers=0``, a background thread) for ``--n`` micro-batches, with the CPU time
   of each thread (``pthread_getcpuclockid``), the training thread's split into waits that
   found nothing ready (they sleep and are woken: the hand-off's cost) and the rest, and the
   wake-ups per micro-batch; beside it the in-process loader's CPU per micro-batch, and the
   int64 floor (with tensors) in-process and on a thread with the same hand-off: the price
   of a second thread itself. Alternating rounds.

    .venv/bin/python bench/loader_profile.py            # both
    .venv/bin/python bench/loader_profile.py --no-cprofile

Profiles are shares of one process's time, so they hold on a busy machine where absolute
timings do not; BENCHMARKS.md ("Data: loader") cites them.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

SEQ, MICRO, N = 2048, 8, 3000


def _loader(ds, prefetch: int):
    from steadytrain.data.read.loader import TokenLoader

    return TokenLoader(
        ds, SEQ, MICRO * 64, MICRO, seed=0, shuffle="global", num_workers=0, prefetch=prefetch
    )


def profile_inprocess(ds) -> None:
    loader = _loader(ds, 0)
    for _ in range(5000):  # warm: maps touched, numpy's lazily imported helpers loaded
        next(loader)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for _ in range(N):
        next(loader)
    pr.disable()
    print(f"{(time.perf_counter() - t) / N * 1e6:.1f} us per micro-batch under the profiler")
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)


def _thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def thread_round(ds, n: int, prefetch: int) -> dict[str, float]:
    """CPU microseconds per micro-batch of each thread of the default loader."""
    loader = _loader(ds, prefetch)
    for _ in range(300):
        next(loader)
    producer = loader._producer
    handoff, reader_thread = producer._q, producer._thread
    get = producer.get
    blocked = {"n": 0, "cpu": 0.0}

    def timed_get(timeout: float):
        if handoff.items:
            return get(timeout)
        c = time.thread_time()
        item = get(timeout)
        blocked["cpu"] += time.thread_time() - c
        blocked["n"] += 1
        return item

    producer.get = timed_get
    m0, r0 = time.thread_time(), _thread_cpu(reader_thread)
    for _ in range(n):
        next(loader)
    main, reader = time.thread_time() - m0, _thread_cpu(reader_thread) - r0
    loader.close()
    return {
        "training_thread_us": main / n * 1e6,
        "of_it_blocked_waits_us": blocked["cpu"] / n * 1e6,
        "blocked_waits_per_micro_batch": blocked["n"] / n,
        "reading_thread_us": reader / n * 1e6,
        "both_us": (main + reader) / n * 1e6,
    }


def inprocess_round(ds, n: int) -> float:
    loader = _loader(ds, 0)
    for _ in range(300):
        next(loader)
    c = time.thread_time()
    for _ in range(n):
        next(loader)
    return (time.thread_time() - c) / n * 1e6


def _floor(ds):
    """The int64 floor of bench/loader_throughput.py, with the batch wrapped as tensors."""
    import numpy as np
    import torch

    from steadytrain.data.read.sampler import Sampler

    sampler = Sampler([ds], SEQ, MICRO, seed=0)
    maps = [np.asarray(ds.tokens(s)) for s in range(ds.num_shards)]
    refs = sampler.locate(np.random.default_rng(0).permutation(sampler.num_samples[0]))
    pairs = list(zip(refs.shard.tolist(), refs.offset.tolist(), strict=True))
    buf = np.empty((MICRO, SEQ + 1), dtype=np.uint16)
    ids = np.arange(MICRO)
    state = {"i": 0}

    def nxt():
        i = state["i"]
        for row in range(MICRO):
            s, o = pairs[(i + row) % len(pairs)]
            buf[row] = maps[s][o : o + SEQ + 1]
        state["i"] = i + MICRO
        both = np.empty((2, MICRO, SEQ), dtype=np.int64)
        both[0] = buf[:, :-1]
        both[1] = buf[:, 1:]
        return {
            "input_ids": torch.from_numpy(both[0]),
            "labels": torch.from_numpy(both[1]),
            "sample_ids": torch.from_numpy(ids),
        }

    return nxt


def floor_rounds(ds, n: int, prefetch: int) -> tuple[float, float]:
    """CPU us a micro-batch of the floor in-process and on a thread with the loader's
    hand-off (``_Handoff``, the same capacity and group): the price of the second thread."""
    import threading

    from steadytrain.data.read.producers import ThreadProducer, _Handoff

    f = _floor(ds)
    for _ in range(300):
        f()
    c = time.process_time()
    for _ in range(n):
        f()
    inproc = (time.process_time() - c) / n * 1e6
    h = _Handoff(ThreadProducer.capacity(prefetch), max(1, min(prefetch, 8)))

    def produce():
        g = _floor(ds)
        while h.put(g()):
            pass

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    for _ in range(300):
        while h.get(0.05) is None:
            pass
    c = time.process_time()
    for _ in range(n):
        while h.get(0.05) is None:
            pass
    threaded = (time.process_time() - c) / n * 1e6
    h.close()
    t.join(1.0)
    return inproc, threaded


def measure_handoff(ds, n: int, rounds: int, prefetch: int) -> None:
    rows: dict[str, list[float]] = {}
    for _ in range(rounds):  # alternating: the machine's load falls on all alike
        for k, v in thread_round(ds, n, prefetch).items():
            rows.setdefault(k, []).append(v)
        rows.setdefault("in-process loader, us", []).append(inprocess_round(ds, n))
        fin, fth = floor_rounds(ds, n, prefetch)
        rows.setdefault("floor + tensors in-process, us", []).append(fin)
        rows.setdefault("same floor on a thread, us", []).append(fth)
    print(f"\nthread mode (prefetch={prefetch}), {rounds} rounds of {n} micro-batches:")
    print("  CPU us a micro-batch, median (min-max)")
    for k, vs in rows.items():
        print(f"  {k:34s} {statistics.median(vs):8.2f} ({min(vs):.2f}-{max(vs):.2f})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-cprofile", action="store_true")
    p.add_argument("--n", type=int, default=3000, help="micro-batches a round (thread mode)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefetch", type=int, default=4, help="the loader's default: 4")
    a = p.parse_args()
    from _loader_common import make_dataset
    from steadytrain.data.read.dataset import TokenDataset

    ds = TokenDataset.open(make_dataset("tp32m", 32 << 20))
    if not a.no_cprofile:
        profile_inprocess(ds)
    measure_handoff(ds, a.n, a.rounds, a.prefetch)


if __name__ == "__main__":
    main()
