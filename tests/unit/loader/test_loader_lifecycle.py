"""TokenLoader lifecycle: a loader dropped without close() leaves no thread or process behind.

Issue 12 item 8: 12 loaders created, partly iterated and dropped left 12 threads and 6 worker
processes running, because the background thread held the loader through a bound method.
These tests drop real loaders (a real thread, real spawned workers) and count what is left.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
import weakref

import psutil
import pytest

from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader

SEQ = 16
SETTLE_S = 30.0  # a bound on waiting for threads and processes to end, not a speed claim


def loader(ds, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, global_batch=8, micro_batch=2, seed=1)
    args.update(kw)
    return TokenLoader(ds, **args)


Alive = tuple[frozenset[threading.Thread], frozenset[int]]


def _alive_now() -> Alive:
    """This process's Python threads, and the pids of its live child processes.
    Sets, not counts: threads that other tests left running in this process (a background
    replay's worker, say) may end during a test, which is no loader's doing."""
    children = [c.pid for c in psutil.Process().children(recursive=True) if _alive(c)]
    return frozenset(threading.enumerate()), frozenset(children)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left_behind(before: Alive) -> tuple[int, int]:
    """Collect garbage and poll until no thread or child process is alive that was not
    alive ``before`` (or the bound passes); how many such threads and processes remain."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        gc.collect()
        threads, procs = _alive_now()
        new = (len(threads - before[0]), len(procs - before[1]))
        if new == (0, 0) or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def _running(producer) -> bool:
    """Whether a producer's thread (or any of its worker processes) still runs."""
    procs = getattr(producer, "_procs", [])
    return producer._thread.is_alive() or any(p.is_alive() for p in procs)


def _baseline(ds, num_workers: int) -> Alive:
    # One loader started and closed first: spawning workers starts multiprocessing's
    # resource tracker once per process, which is not a leak.
    with loader(ds, num_workers=num_workers) as ld:
        next(ld)
    return _alive_now()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropped_loaders_stop_their_threads_and_workers(ds_a, num_workers):
    base = _baseline(ds_a, num_workers)
    refs = []
    for i in range(4):
        holder: dict = {}
        # One in two sits in a reference cycle (a step callback that refers to its loader,
        # as a trainer's hook may): only the garbage collector can free those.
        on_step = (lambda step, h=holder: h.get("ld")) if i % 2 else None
        ld = loader(ds_a, seed=i, num_workers=num_workers, on_step=on_step)
        holder["ld"] = ld if i % 2 else None
        for _ in range(3):  # partly iterated: the producer is running and reading ahead
            next(ld)
        assert ld._producer is not None and _running(ld._producer)
        if num_workers:
            assert len(ld._producer.pids) == num_workers
        refs.append(weakref.ref(ld))
        del ld, holder, on_step
    assert _left_behind(base) == (0, 0), "threads / child processes left behind by dropped loaders"
    assert all(r() is None for r in refs), "a dropped loader is still referenced"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("steadytrain-loader")]


@pytest.mark.timeout(120)
def test_a_dropped_loader_is_freed_at_once_without_the_collector(ds_a):
    """No cycle through the producer: the last reference going frees the loader, and its
    ``__del__`` closes the producer (as the thread holds the loader only weakly)."""
    base = _baseline(ds_a, 0)
    ld = loader(ds_a)
    next(ld)
    producer, ref = ld._producer, weakref.ref(ld)
    gc.disable()  # prove it is reference counting, not a collection, that frees it
    try:
        del ld
        assert ref() is None
    finally:
        gc.enable()
    producer._thread.join(SETTLE_S)
    assert not _running(producer)
    assert _left_behind(base) == (0, 0)


def _failing_dataset(ds_a) -> TokenDataset:
    """The same dataset, whose first shard reads and whose other shards fail to fetch."""
    ds = TokenDataset.open(ds_a.url)

    def failing_resolver(name: str, size: int, checksum: str) -> str:
        if not name.endswith("shard-00000.tokens"):
            raise OSError(f"cannot fetch {name}")
        return ds.store.local_path(name)

    ds._resolver = failing_resolver
    return ds


@pytest.mark.timeout(120)
def test_a_pending_read_error_does_not_keep_a_dropped_loader_alive(ds_a):
    """The producer meets an error ahead of the trainer and queues it; the trainer drops the
    loader before reaching it. The queued exception's frames must not hold the loader."""
    base = _baseline(ds_a, 0)
    ds = _failing_dataset(ds_a)
    ld = loader(ds, shuffle="sequential", prefetch=8)  # shard 0 holds micro-batches 0..4
    next(ld)
    producer, ref = ld._producer, weakref.ref(ld)
    deadline = time.monotonic() + SETTLE_S
    while _running(producer) and time.monotonic() < deadline:  # it stops once the error is queued
        time.sleep(0.02)  # (or blocks on the full queue, holding the error)
    del ld
    assert _left_behind(base) == (0, 0)
    assert ref() is None


@pytest.mark.timeout(120)
def test_a_read_error_still_reaches_the_trainer_with_its_traceback(ds_a):
    ds = _failing_dataset(ds_a)
    with loader(ds, shuffle="sequential") as ld:
        with pytest.raises(OSError, match="cannot fetch shards/shard-00001.tokens") as err:
            for _ in range(100):
                next(ld)
    where = "".join(traceback.format_exception(err.value))
    assert "failing_resolver" in where  # the frames are kept; only their locals are dropped
