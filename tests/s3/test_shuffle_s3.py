"""``steadytrain shuffle DATASET --out s3://...``: the offline pre-shuffle written to a real S3
server (SeaweedFS) is the same dataset as a local shuffle, holds every input sample once, and
passes ``verify``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import s3fs

from steadytrain.cli import main
from steadytrain.data.ingest.verify import verify_dataset
from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.data.read.loader import TokenLoader
from steadytrain.data.read.sampler import Sampler

pytestmark = pytest.mark.s3

SEQ = 32


def windows(ds: TokenDataset, seq_len: int) -> np.ndarray:
    """Every sample's ``seq_len`` input tokens, one row each, in sample-id order."""
    sampler = Sampler([ds], seq_len, 1, mode="sequential")
    refs = sampler.locate(np.arange(sampler.num_samples[0]))
    return np.stack(
        [
            np.asarray(ds.tokens(s)[o : o + seq_len], dtype=np.int64)
            for s, o in zip(refs.shard.tolist(), refs.offset.tolist(), strict=True)
        ]
    )


def sorted_rows(a: np.ndarray) -> np.ndarray:
    """The rows as a multiset: sorted lexicographically."""
    return a[np.lexsort(a.T[::-1])]


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Credentials and endpoint from the environment, as the CLI gets them in a job."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()  # env is read when a filesystem connects
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_shuffle_to_s3_equals_local_shuffle_and_verifies(s3_env, s3_bucket, tmp_path, capsys):
    src = str(tmp_path / "src")
    rng = np.random.default_rng(7)
    with DatasetWriter(
        src, vocab_size=300, eos_id=0, tokenizer={"kind": "test"}, shard_tokens=700
    ) as w:
        for _ in range(30):
            w.add_document(np.append(rng.integers(1, 300, size=int(rng.integers(20, 150))), 0))
    args = ["--seq-len", str(SEQ), "--seed", "5", "--windows-per-shard", "9", "--json"]
    local_out = str(tmp_path / "shuffled")
    assert main(["shuffle", src, "--out", local_out, *args]) == 0
    local_summary = json.loads(capsys.readouterr().out)
    assert main(["shuffle", src, "--out", s3_bucket, *args]) == 0
    remote_summary = json.loads(capsys.readouterr().out)
    assert remote_summary["num_samples"] == local_summary["num_samples"] > 9  # several shards
    assert remote_summary["fingerprint"] == local_summary["fingerprint"]

    source = TokenDataset.open(src)
    local = TokenDataset.open(local_out)
    remote = TokenDataset.open(s3_bucket, cache_dir=str(tmp_path / "cache"))
    assert remote.fingerprint == local.fingerprint
    assert remote.manifest.extra["shuffled"]["source"] == source.fingerprint
    assert remote.num_shards == local.num_shards > 1 and remote.num_tokens == local.num_tokens
    for s in range(local.num_shards):  # byte for byte the local shuffle's output
        assert np.array_equal(remote.tokens(s), local.tokens(s))
        assert np.array_equal(remote.doc_ends(s), local.doc_ends(s))
    # Every input sample exactly once (inputs exact), in an order that is not the input's.
    got, want = windows(remote, SEQ), windows(source, SEQ)
    assert got.shape == want.shape
    assert np.array_equal(sorted_rows(got), sorted_rows(want))
    assert not np.array_equal(got, want)

    report = verify_dataset(s3_bucket)
    assert report.ok, [str(p) for p in report.problems]
    assert report.checked_files >= 2 * remote.num_shards
    # The loader streams the remote copy exactly as the local one.
    kw = dict(seq_len=SEQ, global_batch=4, micro_batch=2, shuffle="sequential")
    with TokenLoader(remote, **kw) as a, TokenLoader(local, **kw) as b:
        for _ in range(6):
            x, y = next(a), next(b)
            assert x["input_ids"].equal(y["input_ids"]) and x["labels"].equal(y["labels"])
