"""Datasets on a real S3 server (SeaweedFS): remote output, identical reads, clear errors,
and the ``stage`` command."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import s3fs

from steadytrain.cli import main
from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset
from steadytrain.errors import DatasetError, StorageError
from steadytrain.storage.store import Store

pytestmark = pytest.mark.s3


def write_docs(dest, seed: int = 0, docs: int = 80, shard_tokens: int = 6000):
    rng = np.random.default_rng(seed)
    with DatasetWriter(
        dest, vocab_size=70000, eos_id=0, tokenizer={"kind": "test"}, shard_tokens=shard_tokens
    ) as w:
        for _ in range(docs):
            w.add_document(np.append(rng.integers(1, 70000, size=int(rng.integers(20, 400))), 0))
    return w


@pytest.fixture
def remote_and_local(s3_server, s3_bucket, tmp_path):
    remote = Store(s3_bucket, s3_server.storage_options)
    write_docs(remote)
    write_docs(str(tmp_path / "local"))
    return s3_bucket, str(tmp_path / "local")


def test_writer_to_s3_and_reads_identical_to_local(s3_server, remote_and_local, tmp_path):
    url, local_dir = remote_and_local
    remote = TokenDataset.open(
        url, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.storage_options
    )
    local = TokenDataset.open(local_dir)
    assert remote.fingerprint == local.fingerprint and remote.num_shards == local.num_shards > 2
    assert remote.dtype == np.dtype("<u4")
    for i in range(local.num_shards):
        assert np.array_equal(remote.tokens(i), local.tokens(i))
        assert np.array_equal(remote.doc_ends(i), local.doc_ends(i))
    m = remote.cache.metrics()
    assert m["downloads"] == 2 * local.num_shards and m["bytes_fetched"] > 0
    # Listing shows exactly the published files: no temporary objects were left behind.
    names = Store(url, s3_server.storage_options).listdir("shards")
    assert len(names) == 2 * local.num_shards and all(
        n.endswith((".tokens", ".idx")) for n in names
    )


@pytest.mark.skipif(
    importlib.util.find_spec("steadytrain.data.read.loader") is None,
    reason="steadytrain.data.read.loader (issue 3) is not in the tree yet",
)
def test_loader_stream_over_s3_equals_local(s3_server, remote_and_local, tmp_path):
    from steadytrain.data.read.loader import TokenLoader

    url, local_dir = remote_and_local
    remote = TokenDataset.open(
        url, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.storage_options
    )
    local = TokenDataset.open(local_dir)

    def stream(ds):
        loader = TokenLoader(ds, seq_len=32, global_batch=8, micro_batch=4, seed=3)
        it = iter(loader)
        return [next(it) for _ in range(12)]

    for a, b in zip(stream(remote), stream(local), strict=True):
        for key in ("input_ids", "labels", "sample_ids"):
            assert a[key].equal(b[key])


def test_aborted_remote_write_publishes_nothing(s3_server, s3_bucket):
    store = Store(s3_bucket, s3_server.storage_options)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        with DatasetWriter(store, vocab_size=300, eos_id=0, tokenizer={}, shard_tokens=500) as w:
            w.add_document(np.append(np.arange(1, 700) % 299 + 1, 0))  # one full shard
            w.add_document(np.array([5, 6, 0]))  # a second, still open
            raise RuntimeError("tokenizer crashed")
    assert not store.exists("manifest.json")
    assert store.listdir("shards") == ["shards/shard-00000.idx", "shards/shard-00000.tokens"]
    with pytest.raises(DatasetError, match="manifest.json does not exist"):
        TokenDataset.open(
            s3_bucket, cache_dir="/nonexistent", storage_options=s3_server.storage_options
        )


def test_clear_errors_credentials_bucket_object(s3_server, remote_and_local, tmp_path):
    url, _ = remote_and_local
    bad = {**s3_server.storage_options, "secret": "not-the-secret"}
    with pytest.raises(
        StorageError, match=f"{url}/manifest.json: access denied.*AWS_SECRET_ACCESS_KEY"
    ):
        TokenDataset.open(url, cache_dir=str(tmp_path / "c"), storage_options=bad)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        TokenDataset.open(
            "s3://no-such-bucket/ds",
            cache_dir=str(tmp_path / "c"),
            storage_options=s3_server.storage_options,
        )
    store = Store(url, s3_server.storage_options)
    with pytest.raises(StorageError, match=f"{url}/shards/missing.tokens does not exist"):
        store.read_bytes("shards/missing.tokens")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        Store("s3://no-such-bucket/out", s3_server.storage_options).write_bytes_atomic("x", b"1")


def test_stage_command_with_env_credentials(
    s3_server, remote_and_local, tmp_path, monkeypatch, capsys
):
    url, local_dir = remote_and_local
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    cache = str(tmp_path / "node-cache")
    assert (
        main(
            [
                "stage",
                url,
                "--cache",
                cache,
                "--steps",
                "0:1",
                "--shuffle",
                "sequential",
                "--seq-len",
                "16",
                "--global-batch",
                "2",
                "--json",
            ]
        )
        == 0
    )
    part = json.loads(capsys.readouterr().out)
    assert part["shards"] == 1 and part["steps"] == [0, 1] and part["verified"]
    assert main(["stage", url, "--cache", cache, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    n = TokenDataset.open(local_dir).num_shards
    assert whole["shards"] == n and whole["bytes_already_cached"] == part["bytes"]
    assert whole["bytes_fetched"] == whole["bytes"] - part["bytes"] and whole["gbps"] > 0
    assert main(["stage", url, "--cache", cache]) == 0
    assert "0.0 MB fetched" in capsys.readouterr().out
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    s3fs.S3FileSystem.clear_instance_cache()  # as in a fresh process: env is read at connect
    assert main(["stage", url, "--cache", cache]) == 2
    assert "access denied" in capsys.readouterr().err


def test_loader_with_prefetcher_over_s3(s3_server, s3_bucket, tmp_path):
    from steadytrain.data.read.loader import TokenLoader
    from steadytrain.storage.prefetch import Prefetcher

    write_docs(Store(s3_bucket, s3_server.storage_options), docs=200, shard_tokens=3000)
    write_docs(str(tmp_path / "local"), docs=200, shard_tokens=3000)
    remote = TokenDataset.open(
        s3_bucket, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.storage_options
    )
    local = TokenDataset.open(str(tmp_path / "local"))
    kw = dict(seq_len=64, global_batch=8, micro_batch=4, seed=1, shuffle="sequential")
    loader, ref = TokenLoader(remote, **kw), TokenLoader(local, **kw)
    pf = Prefetcher.for_loader(loader, horizon_steps=6, workers=2)
    assert pf is not None and Prefetcher.for_loader(ref) is None  # local data: no cache
    try:
        for _ in range(2 * 40):  # 40 steps of 2 micro-batches
            a, b = next(loader), next(ref)
            assert a["input_ids"].equal(b["input_ids"]) and a["sample_ids"].equal(b["sample_ids"])
        assert pf.wait_idle(timeout=30) and pf.errors == 0
        m = remote.cache.metrics()
        used = {k for _, k in loader.shards_for_steps(0, 40 + 6)}
        assert m["downloads"] == 2 * len(used)  # every needed file fetched once, nothing else
        assert m["prefetch_ahead_steps"] is not None and m["prefetch_ahead_steps"] >= 1
        lm = loader.metrics()  # the loader reports the cache's counters for the ledger
        assert (lm["cache_hits"], lm["cache_misses"]) == (m["cache_hits"], m["cache_misses"])
        assert m["cache_hits"] + m["cache_misses"] > 0
    finally:
        pf.close()
        loader.close()
        ref.close()


def test_loader_counts_cache_misses_inside_its_worker_processes(s3_server, s3_bucket, tmp_path):
    """With num_workers > 0 the shards are opened in the workers, each with its own cache
    object: their misses reach the loader's metrics (and so every rank's ledger)."""
    from steadytrain.data.read.loader import TokenLoader

    write_docs(Store(s3_bucket, s3_server.storage_options), docs=200, shard_tokens=3000)
    remote = TokenDataset.open(
        s3_bucket, cache_dir=str(tmp_path / "cache"), storage_options=s3_server.storage_options
    )
    kw = dict(seq_len=64, global_batch=8, micro_batch=4, seed=1, shuffle="sequential")
    loader = TokenLoader(remote, num_workers=1, **kw)
    try:
        misses = hits = 0
        for _ in range(30):  # 15 steps of 2 micro-batches, a metrics() call per step
            next(loader)
            next(loader)
            m = loader.metrics()
            misses, hits = misses + m["cache_misses"], hits + m["cache_hits"]
        used = {k for _, k in loader.shards_for_steps(0, 15)}
        assert remote.cache is None or remote.cache.metrics()["cache_misses"] == 0  # not here
        assert misses >= len(used)  # every shard first opened in the worker: one miss each
    finally:
        loader.close()
