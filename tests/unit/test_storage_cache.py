"""ShardCache against a local source directory: fetch, verify, publish, lock, sweep, full disk."""

from __future__ import annotations

import fcntl
import os
import threading
import uuid

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.data.read.dataset import open_shard_cache
from steadytrain.data.read.format import read_manifest
from steadytrain.errors import DatasetError, StorageError
from steadytrain.storage.publish import file_checksum
from steadytrain.storage.store import Store
from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs


def make_dataset(dest: str, docs: int = 40, shard_tokens: int = 4000, seed: int = 0) -> Store:
    rng = np.random.default_rng(seed)
    with DatasetWriter(
        dest, vocab_size=500, eos_id=0, tokenizer={"kind": "test"}, shard_tokens=shard_tokens
    ) as w:
        for _ in range(docs):
            w.add_document(np.append(rng.integers(1, 500, size=int(rng.integers(50, 600))), 0))
    return Store(dest)


@pytest.fixture
def source(tmp_path):
    store = make_dataset(str(tmp_path / "src"))
    return store, read_manifest(store)


def test_fetch_verifies_publishes_and_hits(source, tmp_path):
    store, manifest = source
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    s = manifest.shards[1]
    path = cache.local_path(s.name, s.bytes, s.checksum)
    assert path.startswith(str(tmp_path / "cache" / manifest.fingerprint))
    assert file_checksum(path) == s.checksum
    assert open(path, "rb").read() == open(store.local_path(s.name), "rb").read()
    assert cache.local_path(s.name, s.bytes, s.checksum) == path
    m = cache.metrics()
    assert (m["downloads"], m["cache_misses"], m["cache_hits"], m["bytes_fetched"]) == (
        1,
        1,
        1,
        s.bytes,
    )
    assert m["read_p50_s"] is not None and m["read_p99_s"] >= m["read_p50_s"]
    # A second process (new instance) trusts the stamp: no download.
    again = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    again.local_path(s.name, s.bytes, s.checksum)
    assert again.metrics()["downloads"] == 0 and again.metrics()["cache_hits"] == 1
    assert cache.metrics(reset=True)["downloads"] == 1 and cache.metrics()["downloads"] == 0
    assert not os.listdir(os.path.join(cache.root, ".tmp"))


def test_corrupted_cache_file_is_detected_and_refetched(source, tmp_path):
    store, manifest = source
    s = manifest.shards[0]
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest, chunk_bytes=1000)
    path = cache.local_path(s.name, s.bytes, s.checksum)
    with open(path, "r+b") as f:  # same size, different bytes (a bit rot / stray write)
        f.seek(100)
        f.write(b"\xff\xff\xff\xff")
    assert file_checksum(path) != s.checksum
    fresh = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    path2 = fresh.local_path(s.name, s.bytes, s.checksum)
    assert file_checksum(path2) == s.checksum
    assert fresh.metrics()["corrupt_refetches"] == 1 and fresh.metrics()["downloads"] == 1
    # Truncation is caught by the size check even in verify="size" mode.
    with open(path2, "r+b") as f:
        f.truncate(10)
    sized = open_shard_cache(str(tmp_path / "cache"), store, manifest, verify="size")
    assert file_checksum(sized.local_path(s.name, s.bytes, s.checksum)) == s.checksum


def test_checksum_mode_catches_corruption_that_keeps_mtime(source, tmp_path):
    store, manifest = source
    s = manifest.shards[0]
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    path = cache.local_path(s.name, s.bytes, s.checksum)
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\x01\x02")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # hide the write from the stamp
    strict = open_shard_cache(str(tmp_path / "cache"), store, manifest, verify="checksum")
    assert file_checksum(strict.local_path(s.name, s.bytes, s.checksum)) == s.checksum
    assert strict.metrics()["corrupt_refetches"] == 1


def test_remote_file_not_matching_manifest_is_refused(source, tmp_path):
    store, manifest = source
    s = manifest.shards[2]
    with open(store.local_path(s.name), "r+b") as f:
        f.write(b"\x00\x00\x00")
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    with pytest.raises(DatasetError, match=f"{s.name}.*checksum.*steadytrain verify"):
        cache.local_path(s.name, s.bytes, s.checksum)
    assert not os.path.exists(cache.path(s.name))
    assert not os.listdir(os.path.join(cache.root, ".tmp"))


def test_threads_racing_download_once(source, tmp_path):
    store, manifest = source
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest, chunk_bytes=64)
    s = manifest.shards[0]
    barrier = threading.Barrier(6)
    paths = []

    def worker():
        barrier.wait()
        paths.append(cache.local_path(s.name, s.bytes, s.checksum))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and cache.metrics()["downloads"] == 1


def test_stale_part_files_are_swept_unless_a_download_holds_the_lock(source, tmp_path):
    store, manifest = source
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    s0, s1 = manifest.shards[0], manifest.shards[1]
    dead = os.path.join(cache.root, ".tmp", f"{cache._quoted(s0.name)}@999999@dead.part")
    live = os.path.join(cache.root, ".tmp", f"{cache._quoted(s1.name)}@{os.getpid()}@live.part")
    for p in (dead, live):
        with open(p, "wb") as f:
            f.write(b"partial")
    # A live download holds its file's flock: its .part must survive the sweep.
    fd = os.open(
        os.path.join(cache.root, ".state", cache._quoted(s1.name) + ".lock"), os.O_RDWR | os.O_CREAT
    )
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        open_shard_cache(str(tmp_path / "cache"), store, manifest)  # sweeps at construction
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        os.close(fd)
    open_shard_cache(str(tmp_path / "cache"), store, manifest)
    assert not os.path.exists(live)
    # The partial files were never published under the real names.
    assert not os.path.exists(cache.path(s0.name)) and not os.path.exists(cache.path(s1.name))


def test_evict_shard_keeps_open_maps_valid(source, tmp_path):
    store, manifest = source
    cache = open_shard_cache(str(tmp_path / "cache"), store, manifest)
    s = manifest.shards[0]
    arr = np.memmap(cache.local_path(s.name, s.bytes, s.checksum), dtype=manifest.dtype, mode="r")
    before = np.array(arr[:50])
    assert cache.shard_cached(0) is False  # index file not fetched yet
    cache.ensure_shard(0)
    assert cache.shard_cached(0) and cache.usage_bytes() == cache.shard_bytes(0)
    assert cache.evict_shard(0) == cache.shard_bytes(0)
    assert not cache.shard_cached(0) and cache.usage_bytes() == 0
    assert np.array_equal(arr[:50], before)  # unlink never breaks a live mapping
    cache.local_path(s.name, s.bytes, s.checksum)
    assert cache.metrics()["downloads"] == 3 and cache.metrics()["evictions"] == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    try:
        with tmpfs(tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}", "64k") as mnt:
            yield mnt
    except TmpfsUnavailable:
        pytest.skip("cannot mount a tmpfs here (needs root): full-disk test skipped")


def test_full_disk_gives_clear_error_and_corrupts_nothing(tmp_path, small_tmpfs, monkeypatch):
    store = make_dataset(str(tmp_path / "src"), docs=200, shard_tokens=12000)
    manifest = read_manifest(store)
    cache = open_shard_cache(small_tmpfs, store, manifest)
    published = []
    with pytest.raises(StorageError, match=f"cache directory {small_tmpfs} is full"):
        for s in manifest.shards:
            cache.local_path(s.name, s.bytes, s.checksum)
            published.append(s)
    assert published, "the first shard should fit"
    for s in published:
        assert file_checksum(cache.path(s.name)) == s.checksum
    assert not os.listdir(os.path.join(cache.root, ".tmp"))
    # The size pre-check can be beaten by a racing writer: a real ENOSPC mid-write is clean too.
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    s = manifest.shards[len(published)]
    filler = os.path.join(small_tmpfs, "filler")
    monkeypatch.setattr(cache, "_check_space", lambda name, size: None)  # lose the race
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - s.bytes // 2))
    with pytest.raises(StorageError, match="is full"):
        cache.local_path(s.name, s.bytes, s.checksum)
    assert not os.path.exists(cache.path(s.name))
    assert not os.listdir(os.path.join(cache.root, ".tmp"))
