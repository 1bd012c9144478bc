"""Offline pre-shuffle: rewrite a dataset so that reading it in order reads shuffled samples.

Output window ``j`` is the ``seq_len`` input tokens of input sample ``pi(j)``, where ``pi``
is a keyed Feistel permutation of all samples (no index, so memory stays bounded by one
chunk of windows however large the dataset). Each output shard holds a whole number ``m``
of windows plus one token, the true label of its last window, so the output has exactly
``m`` samples per shard at the same ``seq_len`` and ``shuffle="sequential"`` reads them in
shuffled order. Inputs are exact; labels are exact except the last label of a window that
is not last in its shard, which is the first token of the next window (one token in
``seq_len``, like a document boundary without EOS). Document boundaries inside a window
are kept in the output's document index; a window start is a document start.

The result is written with ``DatasetWriter``, so the destination may be any URL and the
manifest appears last. The stored ``tokenizer.json`` (if the source has one) is copied
before the manifest, so the output names only files it holds and ``verify`` passes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.permute import Feistel, derive_key
from steadytrain.data.read.sampler import Sampler
from steadytrain.errors import ConfigError, DatasetError
from steadytrain.storage.store import Store, safe_relpath

__all__ = ["ShuffleResult", "shuffle_dataset"]

CHUNK_WINDOWS = 4096
SHUFFLE_PURPOSE = 0x5348554646  # key domain separation from the loader's own orders


@dataclasses.dataclass(frozen=True)
class ShuffleResult:
    out: str
    num_samples: int
    num_shards: int
    num_tokens: int
    fingerprint: str
    seconds: float


def shuffle_dataset(
    ds: TokenDataset,
    dest: str,
    *,
    seq_len: int,
    seed: int = 0,
    windows_per_shard: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ShuffleResult:
    """Write the windows of ``ds`` in a keyed random order to ``dest`` (a path or URL)."""
    t0 = time.perf_counter()
    sampler = Sampler([ds], seq_len, 1, mode="sequential")  # the sample space, nothing more
    n = sampler.num_samples[0]
    if windows_per_shard is None:
        typical = int(np.median(ds.shard_token_counts()))
        windows_per_shard = max(1, typical // seq_len)
    if windows_per_shard < 1:
        raise ConfigError(f"windows_per_shard must be >= 1, got {windows_per_shard}")
    perm = Feistel(n, derive_key(seed, SHUFFLE_PURPOSE))
    extra = {
        "shuffled": {
            "source": ds.fingerprint,
            "seq_len": seq_len,
            "seed": seed,
            "order": "feistel-v1",
        }
    }
    writer = DatasetWriter(
        dest,
        vocab_size=ds.vocab_size,
        eos_id=ds.eos_id,
        tokenizer=ds.manifest.tokenizer,
        shard_tokens=windows_per_shard * seq_len + 1,
        extra=extra,
    )
    try:
        for lo in range(0, n, CHUNK_WINDOWS):
            j = np.arange(lo, min(n, lo + CHUNK_WINDOWS), dtype=np.int64)
            refs = sampler.locate(perm(j))
            # The last window of each output shard carries one more token: its last label.
            last = ((j % windows_per_shard) == windows_per_shard - 1) | (j == n - 1)
            tokens, lengths = _gather(ds, refs.shard, refs.offset, last, seq_len)
            try:
                writer.add_documents(tokens, lengths)
            except DatasetError as exc:  # the writer knows no source file: name the dataset
                shards = sorted({ds.manifest.shards[int(i)].name for i in refs.shard})
                raise DatasetError(
                    f"{ds.url}: {exc} in one of {', '.join(shards[:4])}"
                    f"{' ...' if len(shards) > 4 else ''}; the source dataset is damaged: run "
                    f"`steadytrain verify {ds.url}`, then restore or re-tokenize it"
                ) from exc
            if progress is not None:
                progress(int(j[-1]) + 1, n)
        _copy_tokenizer_file(ds, writer.store)
    except BaseException:
        writer.abort()  # no manifest: nothing half-written is ever taken for a dataset
        raise
    manifest = writer.close()
    return ShuffleResult(
        dest,
        n,
        len(manifest.shards),
        manifest.num_tokens,
        manifest.fingerprint,
        time.perf_counter() - t0,
    )


def _gather(
    ds: TokenDataset, shards: np.ndarray, offsets: np.ndarray, last: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Windows' tokens back to back and their document pieces' lengths."""
    sizes = seq_len + last.astype(np.int64)
    tokens = np.empty(int(sizes.sum()), dtype=ds.dtype)
    lengths: list[np.ndarray] = []
    pos = 0
    for s, o, size in zip(shards.tolist(), offsets.tolist(), sizes.tolist(), strict=True):
        tokens[pos : pos + size] = ds.tokens(s)[o : o + size]
        ends = ds.doc_ends(s)
        a = int(np.searchsorted(ends, o, side="right"))
        b = int(np.searchsorted(ends, o + size, side="left"))
        cuts = np.asarray(ends[a:b], dtype=np.int64) - o  # document ends strictly inside
        lengths.append(np.diff(np.concatenate(([0], cuts, [size]))))
        pos += size
    return tokens, np.concatenate(lengths)


def _copy_tokenizer_file(ds: TokenDataset, dest: Store) -> None:
    """Copy the stored tokenizer file the manifest names, so the output is self-contained."""
    name = (ds.manifest.tokenizer or {}).get("file")
    if not name:
        return
    name = safe_relpath(name, what="manifest tokenizer.file")
    if not ds.store.exists(name):
        raise DatasetError(
            f"{ds.store.display(name)} is named by the manifest but missing; restore it "
            f"(or re-tokenize) before shuffling, or the shuffled copy would not verify"
        )
    dest.write_bytes_atomic(name, ds.store.read_bytes(name))
