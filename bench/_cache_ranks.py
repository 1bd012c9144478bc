"""One rank of ``bench/cache_peers.py``'s own contenders (run in the project's venv):

    python bench/_cache_ranks.py readahead|ours --url s3://... --cache DIR ...

``readahead``: streaming without a cache, the fair baseline: this rank's samples of step
``s`` are plain ranged GETs (one per contiguous run of a shard), issued ``--ahead`` steps
early on a thread pool of that many threads, so a request's latency hides behind the
compute of the steps before it. Nothing is written to disk; a second epoch reads again.

``ours``: ``TokenDataset`` over ``s3://`` with the node's ``ShardCache`` (every rank of the
node passes the same ``cache_dir``) and ``TokenLoader``'s defaults (a background thread,
prefetch 4 micro-batches); one ``Prefetcher`` per rank for the node's ranks, with the
training loop's defaults (horizon 64 steps, 2 fetch threads, ``cache_budget_bytes`` as the
budget), exactly as ``train/support.py``'s ``start_prefetchers`` sets it up.

Both read the same steps in the same order (``shuffle="sequential"``, rank ``r`` of ``W``
reads positions ``[s G + r G/W, s G + (r+1) G/W)``).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "peers"))

from cache_loop import finish, init_dist, model_inputs, rank_args, run_rank  # noqa: E402

from steadytrain.data.read.dataset import TokenDataset  # noqa: E402
from steadytrain.data.read.format import read_manifest  # noqa: E402
from steadytrain.data.read.loader import TokenLoader  # noqa: E402
from steadytrain.data.read.sampler import Sampler  # noqa: E402
from steadytrain.storage.prefetch import Prefetcher  # noqa: E402
from steadytrain.storage.store import Store  # noqa: E402


def storage_options() -> dict:
    if "BENCH_ENDPOINT" not in os.environ:
        return {}  # a local dataset (the unit test of this contender)
    return {
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"endpoint_url": os.environ["BENCH_ENDPOINT"]},
    }


def epoch_starts(manifest, a, world: int) -> list[int]:
    """The steps at which a new epoch starts (the sampler's epoch is N positions)."""
    n = int(sum((s.tokens - 1) // a.seq for s in manifest.shards))
    g = a.per_rank * world
    return [s for s in range(a.steps) if s == 0 or (s * g) // n > ((s - 1) * g) // n]


class ReadAhead:
    """Ranged GETs for step ``s + ahead`` are issued when step ``s`` is taken."""

    def __init__(self, a, rank: int, world: int) -> None:
        self.store = Store(a.url, storage_options())
        manifest = read_manifest(self.store)
        self.names = [s.name for s in manifest.shards]
        self.itemsize = manifest.itemsize
        self.sampler = Sampler([manifest], a.seq, a.per_rank * world, mode="sequential")
        self.epoch_starts = epoch_starts(manifest, a, world)
        self.a, self.rank, self.world = a, rank, world
        self.pool = ThreadPoolExecutor(a.ahead, thread_name_prefix="readahead")
        self.pending: collections.deque = collections.deque()
        self.step = 0
        for s in range(a.ahead):
            self.pending.append(self.pool.submit(self.fetch, s))

    def fetch(self, step: int) -> np.ndarray:
        a = self.a
        first = (step * self.world + self.rank) * a.per_rank
        pos = np.arange(a.per_rank, dtype=np.int64) + first
        refs = self.sampler.locate(pos)
        out = np.empty((a.per_rank, a.seq + 1), dtype=np.uint16)
        row = 0
        while row < len(pos):  # one GET per run of consecutive samples in one shard
            end = row + 1
            while (
                end < len(pos)
                and refs.shard[end] == refs.shard[row]
                and refs.offset[end] == refs.offset[end - 1] + a.seq
            ):
                end += 1
            lo = int(refs.offset[row])
            hi = int(refs.offset[end - 1]) + a.seq + 1
            data = self.store.read_bytes(
                self.names[int(refs.shard[row])], lo * self.itemsize, hi * self.itemsize
            )
            toks = np.frombuffer(data, dtype="<u2")
            for i in range(row, end):
                o = int(refs.offset[i]) - lo
                out[i] = toks[o : o + a.seq + 1]
            row = end
        return out

    def __call__(self):
        fut = self.pending.popleft()
        self.pending.append(self.pool.submit(self.fetch, self.step + self.a.ahead))
        self.step += 1
        return model_inputs(fut.result())


def build_ours(a, rank: int, world: int):
    ds = TokenDataset.open(a.url, cache_dir=a.cache, storage_options=storage_options())
    loader = TokenLoader(
        ds,
        seq_len=a.seq,
        global_batch=a.per_rank * world,
        micro_batch=a.per_rank,
        rank=rank,
        world_size=world,
        shuffle="sequential",
        labels="next",
    )
    pf = Prefetcher.for_loader(
        loader,
        ranks=list(range(world)),  # one node: every rank shares this cache
        horizon_steps=64,  # DataSection.prefetch_steps default
        budget_bytes=a.budget_bytes,
        total_steps=a.steps,
    )
    assert pf is not None, "the dataset is remote: it must be read through a ShardCache"

    def nxt():
        b = next(loader)
        return b["input_ids"], b["labels"]

    nxt.epoch_starts = epoch_starts(ds.manifest, a, world)
    nxt.extra = lambda: {
        "cache": ds.cache.metrics(),
        "evictions_by_this_rank": [list(e) for e in pf.evicted],
        "prefetch_errors": pf.errors,
    }
    return nxt


def main() -> None:
    a = rank_args(lambda p: p.add_argument("--ahead", type=int, default=4))
    rank, world = init_dist()
    t0 = time.perf_counter()
    nxt = ReadAhead(a, rank, world) if a.contender == "readahead" else build_ours(a, rank, world)
    run_rank(nxt, a, time.perf_counter() - t0)
    finish()


if __name__ == "__main__":
    main()
