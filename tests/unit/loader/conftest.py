"""Small real datasets for the loader tests, written with DatasetWriter."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset

SEQ = 16


def write_dataset(
    root: str, samples_per_shard: list[int], *, seq_len: int = SEQ, seed: int = 0, vocab: int = 5000
) -> TokenDataset:
    """Shards with exactly ``samples_per_shard[i]`` samples at ``seq_len``, each split into a
    few documents ending in EOS (id 0), token ids random in [1, vocab)."""
    rng = np.random.default_rng(seed)
    with DatasetWriter(
        root, vocab_size=vocab, eos_id=0, tokenizer={"type": "test"}, shard_tokens=1
    ) as w:
        for count in samples_per_shard:
            n = count * seq_len + 1  # exactly `count` samples
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False))
            lengths = np.diff(np.r_[0, cuts, n])
            tokens = rng.integers(1, vocab, size=n)
            tokens[np.cumsum(lengths) - 1] = 0
            w.shard_tokens = n  # the writer closes the shard right after these documents
            w.add_documents(tokens, lengths)
    return TokenDataset.open(root)


@pytest.fixture(scope="session")
def ds_a(tmp_path_factory) -> Iterator[TokenDataset]:
    """40 samples of seq 16 over 4 shards (one empty of samples): 5 steps of 8 per epoch."""
    root = tmp_path_factory.mktemp("ds_a")
    yield write_dataset(str(root), [10, 14, 0, 16])
    shutil.rmtree(root, ignore_errors=True)  # session dirs outlive the retention policy


@pytest.fixture(scope="session")
def ds_b(tmp_path_factory) -> Iterator[TokenDataset]:
    """A second dataset for blending: 24 samples over 3 shards, other token ids."""
    root = tmp_path_factory.mktemp("ds_b")
    yield write_dataset(str(root), [8, 8, 8], seed=1, vocab=300)
    shutil.rmtree(root, ignore_errors=True)
