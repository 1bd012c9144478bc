"""Faults against a real SeaweedFS server behind a slow loopback link: an outage mid-read,
two processes racing for one shard, a download killed half-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import TokenDataset, open_shard_cache
from steadytrain.data.read.format import read_manifest
from steadytrain.errors import StorageError
from steadytrain.storage.publish import file_checksum
from steadytrain.storage.retry import RetryPolicy
from steadytrain.storage.store import Store
from steadytrain.testing.slowlink import SlowLink

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

# A child process: open the cache through the env-configured endpoint, fetch shard 0, report.
CHILD = r"""
import json, sys
from steadytrain.data.read.format import read_manifest
from steadytrain.data.read.dataset import open_shard_cache
from steadytrain.storage.store import Store
store = Store(sys.argv[1])
cache = open_shard_cache(sys.argv[2], store, read_manifest(store), chunk_bytes=int(sys.argv[3]))
s = read_manifest(store).shards[0]
print("ready", flush=True)
sys.stdin.readline()  # start line: every child begins together
cache.local_path(s.name, s.bytes, s.checksum)
print(json.dumps(cache.metrics()), flush=True)
"""


def write_big(dest, tokens: int = 1 << 20, shards: int = 2) -> None:
    """``shards`` shards of ``tokens`` uint16 tokens (2 MiB each by default)."""
    rng = np.random.default_rng(7)
    with DatasetWriter(dest, vocab_size=1000, eos_id=0, tokenizer={}, shard_tokens=tokens) as w:
        for _ in range(shards):
            w.add_document(np.append(rng.integers(1, 1000, size=tokens - 1), 0))


@pytest.fixture
def dataset(s3_server, s3_bucket):
    write_big(Store(s3_bucket, s3_server.storage_options))
    return s3_bucket


def child_env(server, endpoint: str) -> dict[str, str]:
    return {**os.environ, **server.env(), "STEADYTRAIN_S3_ENDPOINT": endpoint}


def test_server_killed_mid_read_then_restarted(s3_restartable, tmp_path):
    server = s3_restartable
    url = "s3://steady/outage"
    write_big(Store(url, server.storage_options), tokens=1 << 20, shards=1)
    local = str(tmp_path / "local")
    write_big(local, tokens=1 << 20, shards=1)
    link = SlowLink(server.ports["s3.port"], latency_s=0.002, down_bps=4e6)  # ~0.5 s a shard
    try:
        opts = {**server.storage_options, "client_kwargs": {"endpoint_url": link.endpoint}}
        store = Store(
            url, opts, retry=RetryPolicy(request_timeout_s=5, total_s=60, max_backoff_s=0.5)
        )
        ds = TokenDataset(
            url, read_manifest(store), cache_dir=str(tmp_path / "cache"), storage_options=opts
        )
        ds.store, ds.cache.store = store, store  # the outage-tolerant policy for this test
        ds.cache.chunk_bytes = 256 << 10  # several ranged GETs, so the kill lands mid-file
        result: dict = {}

        def read():
            result["tokens"] = np.array(ds.tokens(0))

        reader = threading.Thread(target=read)
        reader.start()
        tmp_dir = os.path.join(ds.cache.root, ".tmp")
        # Poll until bytes arrive (the test's timeout guards a download that never starts).
        while not any(os.path.getsize(os.path.join(tmp_dir, f)) for f in os.listdir(tmp_dir)):
            assert reader.is_alive(), "the read ended before the outage could be injected"
            time.sleep(0.02)
        server.kill()  # mid-download: the proxy sees the server vanish
        # The outage lasts longer than any retrying inside s3fs/botocore: ours must carry it.
        time.sleep(2.5)
        assert reader.is_alive(), "the read must wait for the store, not fail"
        server.start()
        reader.join()  # the test's timeout guards a read that never ends
        assert np.array_equal(result["tokens"], TokenDataset.open(local).tokens(0))
        assert store.stats["retries"] >= 1  # it rode out the outage by retrying
        assert (
            file_checksum(ds.cache.path(ds.manifest.shards[0].name))
            == ds.manifest.shards[0].checksum
        )
    finally:
        link.close()


def test_two_processes_race_for_one_shard_one_download(s3_server, dataset, tmp_path):
    link = SlowLink(s3_server.ports["s3.port"], latency_s=0.005, down_bps=8e6)
    cache_dir = str(tmp_path / "cache")
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, dataset, cache_dir, str(256 << 10)],
                env=child_env(s3_server, link.endpoint),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        metrics = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        link.close()
    assert [p.returncode for p in procs] == [0, 0]
    assert sum(m["downloads"] for m in metrics) == 1
    assert sum(m["cache_misses"] for m in metrics) == 2  # the loser waited, then used it
    store = Store(dataset, s3_server.storage_options)
    s = read_manifest(store).shards[0]
    assert (
        file_checksum(open_shard_cache(cache_dir, store, read_manifest(store)).path(s.name))
        == s.checksum
    )


def test_crash_mid_download_never_leaves_a_usable_partial(s3_server, dataset, tmp_path):
    link = SlowLink(s3_server.ports["s3.port"], latency_s=0.005, down_bps=2e6)
    cache_dir = str(tmp_path / "cache")
    store = Store(dataset, s3_server.storage_options)
    manifest = read_manifest(store)
    s = manifest.shards[0]
    final = os.path.join(cache_dir, manifest.fingerprint, s.name)
    tmp_dir = os.path.join(cache_dir, manifest.fingerprint, ".tmp")
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, dataset, cache_dir, str(128 << 10)],
            env=child_env(s3_server, link.endpoint),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        while not (
            os.path.isdir(tmp_dir)
            and any(os.path.getsize(os.path.join(tmp_dir, f)) > 0 for f in os.listdir(tmp_dir))
        ):
            assert child.poll() is None, "the child ended before it could be killed mid-download"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        link.close()
    assert not os.path.exists(final), "a killed download must never publish the file"
    parts = os.listdir(tmp_dir)
    assert len(parts) == 1 and os.path.getsize(os.path.join(tmp_dir, parts[0])) < s.bytes
    # The next process sweeps the orphan (its lock died with the child) and fetches cleanly.
    cache = open_shard_cache(cache_dir, store, manifest)
    assert os.listdir(tmp_dir) == []
    assert file_checksum(cache.local_path(s.name, s.bytes, s.checksum)) == s.checksum
    assert cache.metrics()["downloads"] == 1


def test_stalled_store_hits_the_request_deadline(s3_server, dataset):
    """A store that accepts connections but never answers (a stall far longer than this
    test's timeout): each attempt is cancelled at ``request_timeout_s`` and the whole read
    ends at ``total_s`` with a clear error. Only the deadlines can end the read, so no clock
    is read here: were they broken, the read would hang and the test's timeout fail it."""
    from steadytrain.errors import ReadDeadlineError

    link = SlowLink(s3_server.ports["s3.port"], latency_s=3600.0)
    try:
        opts = {**s3_server.storage_options, "client_kwargs": {"endpoint_url": link.endpoint}}
        # total_s is 10 attempts' worth: under CI's load one cancelled attempt overran a
        # total of 3 (no retry left); the retry is what this test checks, not the timing.
        policy = RetryPolicy(request_timeout_s=0.4, total_s=4.0, base_s=0.05, max_backoff_s=0.2)
        store = Store(dataset, opts, retry=policy)
        with pytest.raises(ReadDeadlineError, match=f"{dataset}/manifest.json.*STORAGE_RETRY_S"):
            store.read_bytes("manifest.json")
        assert store.stats["requests"] >= 2  # cancelled, then retried
    finally:
        link.close()


def test_no_credentials_at_all_is_a_clear_error(s3_server, dataset, monkeypatch, tmp_path):
    import s3fs

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("STEADYTRAIN_S3_ENDPOINT", s3_server.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(StorageError, match="no credentials found.*AWS_ACCESS_KEY_ID"):
        TokenDataset.open(dataset, cache_dir=str(tmp_path / "c"))
