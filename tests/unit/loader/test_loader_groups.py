"""The background thread reads a group of micro-batches per call (one gather, one cast into
a reused block, the next group staged ahead): what the trainer gets must not change.

Batches equal the in-process loader's one by one, across chunk boundaries and after a
resume at a position inside a group; an error in the middle of a group arrives at its own
micro-batch, after the ones before it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader
from steadytrain.data.read.workers import CHUNK
from steadytrain.errors import DatasetError

SEQ = 16
KEYS = ("input_ids", "labels", "sample_ids")


def _loader(ds, **kw) -> TokenLoader:
    args = dict(seq_len=SEQ, global_batch=8, micro_batch=2, seed=3)
    args.update(kw)
    return TokenLoader(ds, **args)


@pytest.mark.parametrize("labels", ["same", "next"])
def test_grouped_thread_reads_equal_in_process_reads_across_chunks(ds_a, labels):
    n = CHUNK + 9  # past the first chunk of mapped positions: a short group at its end
    with _loader(ds_a, labels=labels, prefetch=0) as ref:
        want = [next(ref) for _ in range(n)]
    for prefetch in (3, 4, 8):  # groups of 3 do not divide a chunk: a short group
        with _loader(ds_a, labels=labels, prefetch=prefetch) as ld:
            got = [next(ld) for _ in range(n)]  # all kept: none may be overwritten
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            for key in KEYS:
                assert torch.equal(g[key], w[key]), (prefetch, i, key)
            assert g["input_ids"].is_contiguous() and g["labels"].is_contiguous()


def test_resume_inside_a_group_reads_the_same_batches(ds_a):
    with _loader(ds_a, prefetch=4) as ld:
        for _ in range(CHUNK - 2):  # two before a chunk's end, inside a group of 4
            next(ld)
        state = ld.state_dict()
        after = [next(ld) for _ in range(12)]
    with _loader(ds_a, prefetch=4) as resumed:
        resumed.load_state_dict(state)
        again = [next(resumed) for _ in range(12)]
    for a, b in zip(after, again, strict=True):
        for key in KEYS:
            assert torch.equal(a[key], b[key])


def test_an_error_inside_a_group_arrives_at_its_own_micro_batch(tmp_path):
    root = str(tmp_path / "ds")
    with DatasetWriter(root, vocab_size=300, eos_id=0, tokenizer={"type": "test"}) as w:
        w.add_documents(np.full(40 * SEQ + 1, 7), [40 * SEQ + 1])
    path = os.path.join(root, TokenDataset.open(root).manifest.shards[0].name)
    toks = np.fromfile(path, dtype="<u2")
    toks[4 * SEQ + 3] = 60000  # sample 4 (sequential order): micro-batch 2 of size 2
    toks.tofile(path)  # same size: only the id is wrong
    ld = _loader(TokenDataset.open(root), shuffle="sequential", prefetch=4)
    with ld:
        got = [next(ld)["sample_ids"].tolist() for _ in range(2)]  # the group's first two
        assert got == [[0, 1], [2, 3]]
        with pytest.raises(DatasetError, match="token id 60000"):
            next(ld)
