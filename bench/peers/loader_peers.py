"""Peer loaders, run inside bench/.env/peers (never imports steadytrain).

    python loader_peers.py torchdata|torchdata-per-sample|litdata|streaming --data DIR ...
    python loader_peers.py torchdata-resume --data DIR --yielded N
    python loader_peers.py megatron-memory --steps S --global-batch G --seq-len L

Each prints one JSON line. All read the same tokens: the steadytrain dataset's shard files
(little-endian uint16), converted to the peer's own format where it has one. Each peer is
set up the way its own documentation recommends for token pretraining (see each ``run_*``);
every one hands the trainer what ours does: fresh, contiguous int64 inputs and labels.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _loader_common import measure  # noqa: E402


def shards(data: str) -> list[np.ndarray]:
    """The dataset's shard files as plain ``np.ndarray`` views of read-only maps: the views
    ours and the floor slice. Slicing the ``np.memmap`` subclass itself costs more per window
    than the copy (it builds a memmap per slice), which handicapped the peer."""
    with open(os.path.join(data, "manifest.json")) as f:
        manifest = json.load(f)
    return [
        np.asarray(
            np.memmap(os.path.join(data, s["name"]), dtype="<u2", mode="r", shape=(s["tokens"],))
        )
        for s in manifest["shards"]
    ]


class MegatronStyleMap:
    """A map-style dataset as Megatron/nanoGPT-style code writes it: sample i -> memmap window."""

    def __init__(self, data: str, seq: int) -> None:
        self.maps = shards(data)
        counts = np.array([(m.size - 1) // seq for m in self.maps])
        self.cum = np.concatenate([[0], np.cumsum(counts)])
        self.seq = seq

    def __len__(self) -> int:
        return int(self.cum[-1])

    def __getitem__(self, i: int):
        import torch

        s = int(np.searchsorted(self.cum, i, side="right") - 1)
        o = (i - int(self.cum[s])) * self.seq
        w = torch.from_numpy(self.maps[s][o : o + self.seq + 1].astype(np.int64))
        return {"input_ids": w[:-1], "labels": w[1:]}


class BatchedMap(MegatronStyleMap):
    """The same dataset fetching a whole micro-batch per call: ``ds[list_of_indices]``.

    torch's DataLoader docs describe this for batched reads: a ``BatchSampler`` as the
    sampler and ``batch_size=None``, so the dataset gets every index of a micro-batch at once
    and no per-sample collate runs. The windows gather into one uint16 buffer and are cast
    to int64 once for the whole batch (what ``to_model_inputs`` does for the other peers).
    """

    def __getitem__(self, idx):
        import torch

        idx = np.asarray(idx, dtype=np.int64)
        shard = np.searchsorted(self.cum, idx, side="right") - 1
        offs = (idx - self.cum[shard]) * self.seq
        buf = np.empty((len(idx), self.seq + 1), dtype=np.uint16)
        for row, (s, o) in enumerate(zip(shard.tolist(), offs.tolist(), strict=True)):
            buf[row] = self.maps[s][o : o + self.seq + 1]
        both = torch.from_numpy(_split_int64(buf))
        return {"input_ids": both[0], "labels": both[1]}


def _split_int64(buf: np.ndarray) -> np.ndarray:
    """``[2, batch, seq]`` int64 inputs and labels from ``[batch, seq + 1]`` windows, one
    whole-batch cast each (a fresh array: the trainer may keep what it got)."""
    both = np.empty((2, buf.shape[0], buf.shape[1] - 1), dtype=np.int64)
    both[0] = buf[:, :-1]
    both[1] = buf[:, 1:]
    return both


def forever(make_iter):
    it = make_iter()

    def nxt():
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = make_iter()
            return next(it)

    return nxt


def to_model_inputs(batch):
    """What the trainer needs from a peer that yields raw ``[batch, seq + 1]`` windows:
    fresh contiguous int64 inputs and labels, each one whole-batch cast (as ours and the
    floor produce them)."""
    import torch

    x = batch
    out = torch.empty((2, x.shape[0], x.shape[1] - 1), dtype=torch.int64)
    out[0].copy_(x[:, :-1])
    out[1].copy_(x[:, 1:])
    return out[0], out[1]


def run_torchdata(a) -> dict:
    """torchdata's StatefulDataLoader fetching whole micro-batches (``BatchedMap``)."""
    import torch
    from torch.utils.data import BatchSampler, RandomSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = BatchedMap(a.data, a.seq)
    g = torch.Generator().manual_seed(0)
    dl = StatefulDataLoader(
        ds,
        sampler=BatchSampler(RandomSampler(ds, generator=g), a.batch, drop_last=True),
        batch_size=None,
        num_workers=a.workers,
        persistent_workers=a.workers > 0,
    )
    return measure(forever(lambda: iter(dl)), a.batch * a.seq, a.warmup, a.run)


def run_torchdata_per_sample(a) -> dict:
    """torchdata's default: one ``__getitem__`` per sample and the default collate (kept
    as a reference row: it shows what the batched fetch saves)."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = MegatronStyleMap(a.data, a.seq)
    g = torch.Generator().manual_seed(0)
    dl = StatefulDataLoader(
        ds,
        batch_size=a.batch,
        shuffle=True,
        num_workers=a.workers,
        generator=g,
        persistent_workers=a.workers > 0,
    )
    return measure(forever(lambda: iter(dl)), a.batch * a.seq, a.warmup, a.run)


def run_litdata(a) -> dict:
    """litdata as its "LLM pre-training" guide sets it up: ``optimize`` with
    ``TokensLoader()`` and ``chunk_size=(2048 + 1) * 8012`` tokens, then
    ``StreamingDataset(item_loader=TokensLoader(block_size=2048 + 1), shuffle=True,
    drop_last=True)`` and ``StreamingDataLoader`` (the guide's ``pin_memory=True`` only where
    CUDA exists). The tokens are int32, as the guide's tokenizer emits them."""
    import torch
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader, optimize

    out = os.path.join(a.work, "litdata")
    if not os.path.exists(os.path.join(out, "index.json")):
        n = len(shards(a.data))
        optimize(
            fn=_litdata_emit,
            inputs=[(a.data, i) for i in range(n)],
            output_dir=out,
            chunk_size=(a.seq + 1) * 8012,
            item_loader=TokensLoader(),
            num_workers=1,
        )
    ds = StreamingDataset(
        input_dir=out,
        item_loader=TokensLoader(block_size=a.seq + 1),
        shuffle=True,
        drop_last=True,
        seed=0,
    )
    dl = StreamingDataLoader(
        ds, batch_size=a.batch, num_workers=a.workers, pin_memory=torch.cuda.is_available()
    )
    nxt = forever(lambda: iter(dl))
    return measure(lambda: to_model_inputs(nxt()), a.batch * a.seq, a.warmup, a.run)


def _litdata_emit(item):
    """One shard's tokens (module level: litdata pickles it into its worker)."""
    import torch

    data, i = item
    yield torch.from_numpy(np.asarray(shards(data)[i]).astype(np.int32))


def run_streaming(a) -> dict:
    """mosaicml-streaming with the defaults its docs recommend ("merely setting
    shuffle=True is performant in nearly all cases": py1e, default block size and
    predownload), the per-device ``batch_size`` passed to the dataset as its docs ask, MDS
    shards of the default 64 MB, uncompressed, one ``ndarray:uint16`` window per sample."""
    import torch
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    out = os.path.join(a.work, "mds")
    if not os.path.exists(os.path.join(out, "index.json")):
        with MDSWriter(out=out, columns={"tokens": f"ndarray:uint16:{a.seq + 1}"}) as w:
            for m in shards(a.data):
                for o in range(0, m.size - a.seq, a.seq):
                    w.write({"tokens": np.asarray(m[o : o + a.seq + 1])})
    ds = StreamingDataset(local=out, shuffle=True, shuffle_seed=0, batch_size=a.batch)
    dl = torch.utils.data.DataLoader(
        ds,
        batch_size=a.batch,
        num_workers=a.workers,
        persistent_workers=a.workers > 0,
        pin_memory=torch.cuda.is_available(),
    )
    nxt = forever(lambda: iter(dl))
    return measure(lambda: to_model_inputs(nxt()["tokens"]), a.batch * a.seq, a.warmup, a.run)


def run_torchdata_resume(a) -> dict:
    """Time to first batch of a fresh StatefulDataLoader loading a state that has yielded
    ``a.yielded`` samples of the current epoch (its RandomSampler replays them)."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = MegatronStyleMap(a.data, a.seq)
    if a.virtual_len:  # a bigger epoch over the same tokens (index i reads sample i % n)
        ds = VirtualLen(ds, a.virtual_len)

    def make():
        g = torch.Generator().manual_seed(0)
        return StatefulDataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=0, generator=g)

    dl = make()
    it = iter(dl)
    next(it)
    state = dl.state_dict()  # after one batch; then claim `yielded` samples instead
    sis = dict(state["_sampler_iter_state"])
    sis["samples_yielded"] = a.yielded
    sis["sampler_iter_state"] = dict(sis["sampler_iter_state"], yielded=a.yielded)
    state.update(
        _sampler_iter_state=sis,
        _sampler_iter_yielded=a.yielded // a.batch,
        _num_yielded=a.yielded // a.batch,
    )
    t0 = time.perf_counter()
    dl2 = make()
    dl2.load_state_dict(state)
    next(iter(dl2))
    return {
        "time_to_first_batch_s": time.perf_counter() - t0,
        "yielded": a.yielded,
        "epoch_len": len(ds),
    }


class VirtualLen:
    def __init__(self, ds, n: int) -> None:
        self.ds, self.n = ds, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.ds[i % len(self.ds)]


def run_megatron_memory(a) -> dict:
    """RSS of a Megatron-core GPTDataset built for ``steps * global_batch`` samples."""
    import psutil
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import Split

    class Tok:
        vocab_size, eod, pad = 50257, 50256, 50256
        unique_identifiers = {"class": "BenchTokenizer"}

    os.makedirs(a.work, exist_ok=True)
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=a.seq,
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        split="1,0,0",
        path_to_cache=None,
        mid_level_dataset_surplus=0.005,
    )
    t0 = time.perf_counter()
    low = MockGPTDataset.build_low_level_dataset(None, config)
    ds = MockGPTDataset(
        low, None, np.arange(len(low)), a.steps * a.global_batch, Split.train, config
    )
    build_s = time.perf_counter() - t0
    ds[min(len(ds) - 1, a.steps * a.global_batch - 1)]
    gc.collect()
    rss = psutil.Process().memory_info().rss
    index_bytes = sum(
        getattr(ds, name).nbytes
        for name in ("document_index", "sample_index", "shuffle_index")
        if hasattr(ds, name)
    )
    return {
        "rss_bytes": rss,
        "rss_growth_bytes": rss - rss0,
        "index_bytes": index_bytes,
        "build_s": build_s,
        "num_samples": a.steps * a.global_batch,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("peer")
    p.add_argument("--data", default="")
    p.add_argument("--work", default="")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--run", type=float, default=3.0)
    p.add_argument("--yielded", type=int, default=0)
    p.add_argument("--virtual-len", type=int, default=0)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=576)
    a = p.parse_args()
    fn = {
        "torchdata": run_torchdata,
        "torchdata-per-sample": run_torchdata_per_sample,
        "litdata": run_litdata,
        "streaming": run_streaming,
        "torchdata-resume": run_torchdata_resume,
        "megatron-memory": run_megatron_memory,
    }[a.peer]
    print(json.dumps(fn(a)), flush=True)
    os._exit(0)  # skip slow worker/shared-memory teardown of some peers


if __name__ == "__main__":
    main()
