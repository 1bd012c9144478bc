"""The peers of ``bench/cache_peers.py``, run inside bench/.env/peers (never imports
steadytrain):

    python cache_peers.py convert --data DIR --out DIR --seq 2048 --shard-bytes N
    python cache_peers.py streaming|litdata --url s3://... --cache DIR ...   (one rank)

``convert`` writes the same tokens in each peer's own format: MDS (one ``ndarray:uint16``
window of ``seq + 1`` tokens per sample, the windows our sampler reads) and litdata's
``optimize`` output (``TokensLoader``, uint16 tokens), with shards/chunks of about our shard
size so that all three caches hold and evict the same granularity.

The rank modes read their data from SeaweedFS through the slow link into a node cache
directory shared by the node's ranks, as each peer's documentation recommends:

- mosaic streaming: ``StreamingDataset(remote=s3://..., local=<node cache>, batch_size=
  <per-device batch>, cache_limit=<budget>)`` with the default ``predownload``
  (8 x batch_size), ``shuffle=False`` (every contender reads the same sequential order), a
  plain ``DataLoader`` (``persistent_workers``); S3 through ``S3_ENDPOINT_URL``.
- litdata: ``StreamingDataset(input_dir=Dir(path=<node cache>, url=s3://...),
  item_loader=TokensLoader(block_size=seq + 1), max_cache_size=<budget>, shuffle=False,
  drop_last=True)``, default ``max_pre_download``, and ``StreamingDataLoader``; S3 through
  ``storage_options`` (boto3 and obstore take the endpoint from it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cache_loop import Epochs, finish, init_dist, model_inputs, rank_args, run_rank  # noqa: E402


def token_shards(data: str) -> list[np.memmap]:
    with open(os.path.join(data, "manifest.json")) as f:
        manifest = json.load(f)
    return [
        np.memmap(os.path.join(data, s["name"]), dtype="<u2", mode="r", shape=(s["tokens"],))
        for s in manifest["shards"]
    ]


def convert(data: str, out: str, seq: int, shard_bytes: int) -> dict:
    from litdata import TokensLoader, optimize
    from streaming import MDSWriter

    t0 = time.perf_counter()
    mds = os.path.join(out, "mds")
    with MDSWriter(
        out=mds, columns={"tokens": f"ndarray:uint16:{seq + 1}"}, size_limit=shard_bytes
    ) as w:
        for m in token_shards(data):
            for o in range(0, m.size - seq, seq):
                w.write({"tokens": np.asarray(m[o : o + seq + 1])})
    mds_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = len(token_shards(data))
    optimize(
        fn=_litdata_emit,
        inputs=[(data, i) for i in range(n)],
        output_dir=os.path.join(out, "litdata"),
        chunk_bytes=shard_bytes,
        item_loader=TokensLoader(),
        num_workers=1,
    )
    return {"mds_s": mds_s, "litdata_s": time.perf_counter() - t0}


def _litdata_emit(item):
    """One shard's tokens (module level: litdata pickles it into its worker)."""
    import torch

    data, i = item
    # uint16 as stored (litdata keeps a tensor's dtype), so it moves the bytes ours moves.
    yield torch.from_numpy(np.array(token_shards(data)[i]).view(np.int16)).view(torch.uint16)


def s3_env() -> dict:
    return {
        "endpoint_url": os.environ["BENCH_ENDPOINT"],
        "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
    }


def build_streaming(a):
    import torch
    from streaming import StreamingDataset

    os.environ["S3_ENDPOINT_URL"] = os.environ["BENCH_ENDPOINT"]
    ds = StreamingDataset(
        remote=a.url,
        local=a.cache,
        batch_size=a.per_rank,
        shuffle=False,
        cache_limit=a.budget_bytes,
    )
    dl = torch.utils.data.DataLoader(
        ds,
        batch_size=a.per_rank,
        num_workers=a.workers,
        persistent_workers=a.workers > 0,
        drop_last=True,  # every step takes a full per-rank batch, as ours does
    )
    return Epochs(dl, lambda b: model_inputs(b["tokens"]))


def build_litdata(a):
    import torch.distributed as dist
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader
    from litdata.streaming import downloader
    from litdata.streaming.resolver import Dir

    # litdata fetches chunks with obstore, which refuses a plain-http endpoint (the test
    # server's: "HTTP error: builder error", BadScheme) unless its client allows http. Real
    # S3 is https and needs no such switch; nothing else about litdata's path changes.
    downloader._OBSTORE_CLIENT_OPTIONS = {
        **downloader._OBSTORE_CLIENT_OPTIONS,
        "allow_http": "true",
    }

    # Local rank 0 first: the others give up on its index.json download after a 1 s lock
    # timeout and then fail ("doesn't contain any index.json file") when it takes longer,
    # as it did on this loaded machine.
    if dist.get_rank() != 0:
        dist.barrier()
    ds = StreamingDataset(
        input_dir=Dir(path=a.cache, url=a.url),
        item_loader=TokensLoader(block_size=a.seq + 1),
        shuffle=False,
        drop_last=True,
        max_cache_size=a.budget_bytes,
        storage_options=s3_env(),
    )
    if dist.get_rank() == 0:
        dist.barrier()
    dl = StreamingDataLoader(ds, batch_size=a.per_rank, num_workers=a.workers)
    return Epochs(dl, model_inputs)


def main() -> None:
    if sys.argv[1] == "convert":
        import argparse

        p = argparse.ArgumentParser()
        p.add_argument("mode")
        p.add_argument("--data", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--seq", type=int, default=2048)
        p.add_argument("--shard-bytes", type=int, required=True)
        c = p.parse_args()
        print(json.dumps(convert(c.data, c.out, c.seq, c.shard_bytes)), flush=True)
        finish()
    a = rank_args()
    init_dist()
    t0 = time.perf_counter()
    nxt = {"streaming": build_streaming, "litdata": build_litdata}[a.contender](a)
    run_rank(nxt, a, time.perf_counter() - t0)
    finish()


if __name__ == "__main__":
    main()
