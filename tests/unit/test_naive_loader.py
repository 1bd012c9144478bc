"""The naive reference loader (steadytrain.testing.naive_loader) grows as the incident did.

It must hand out exactly TokenLoader's batches (the replay compares loaders, not data),
grow its /dev/shm index by ``bytes_per_step`` a step up to ``max_bytes`` (measured by the
meter's own gauges, monitor/memory.py), keep it through ``close()`` (a resume) and delete
it when its ``with`` block ends.
"""

from __future__ import annotations

import os

import pytest
import torch

from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader
from steadytrain.monitor.memory import RssReader
from steadytrain.testing.incidents.common import small_shards
from steadytrain.testing.naive_loader import NaiveIndexLoader, index_tag

KiB = 1 << 10


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    return TokenDataset.open(small_shards(str(tmp_path_factory.mktemp("ds") / "ds"), tokens=20_000))


def test_same_batches_as_tokenloader_and_the_index_grows_per_step(ds, tmp_path) -> None:
    kw = dict(seq_len=32, global_batch=8, micro_batch=2, rank=1, world_size=2, seed=3)
    ref = TokenLoader(ds, **kw)
    naive = NaiveIndexLoader(ds, **kw, shm_dir=str(tmp_path), bytes_per_step=256 * KiB,
                             max_bytes=1024 * KiB, tag="t")  # fmt: skip
    assert naive.micro_per_step == 2 and naive.prefetch == 0  # synchronous reads
    rss = RssReader()
    rss0 = rss()
    sizes = []
    for _ in range(6):  # steps
        for _ in range(naive.micro_per_step):
            a, b = next(ref), next(naive)
            for k in a:
                assert torch.equal(a[k], b[k]), k
        sizes.append(os.path.getsize(naive.path))
    # 256 KiB a step, capped at max_bytes; the mapped, scanned pages are resident here.
    assert sizes == [256 * KiB * min(s, 4) for s in range(1, 7)]
    assert naive.index_bytes == 1024 * KiB
    assert rss() - rss0 >= 512 * KiB
    path = naive.path
    assert os.path.basename(path).startswith("steadytrain-naive-index-t-rank1-")
    naive.close()  # stops reading, as TokenLoader's close (a resume calls it): index kept
    assert os.path.getsize(path) == 1024 * KiB
    next(naive)
    with naive:  # the training loop's `with`: leaving it deletes the index
        pass
    ref.close()
    rss.close()
    assert not os.path.exists(path)
    naive.release()  # twice is fine


def test_bad_sizes_are_refused_with_the_fix(ds, tmp_path) -> None:
    with pytest.raises(ValueError, match="max_bytes >= bytes_per_step"):
        NaiveIndexLoader(ds, 32, 8, 2, shm_dir=str(tmp_path), bytes_per_step=16, max_bytes=8)
    with pytest.raises(FileNotFoundError, match="pass shm_dir"):
        NaiveIndexLoader(ds, 32, 8, 2, shm_dir=str(tmp_path / "missing"))


def test_index_tag_is_per_run_directory(tmp_path) -> None:
    assert index_tag(str(tmp_path / "a")) != index_tag(str(tmp_path / "b"))
    assert index_tag(str(tmp_path / "a")) == index_tag(str(tmp_path / "a"))
