"""``Store.get_file`` downloads a large object in ranged parts, several at once, from a real
SeaweedFS server: the bytes arrive whole, and an object rewritten mid-download, a server
killed mid-download or a full local disk publish nothing and leave nothing behind."""

from __future__ import annotations

import hashlib
import os

import pytest

from steadytrain.errors import SteadyError, StorageError
from steadytrain.storage.retry import RetryPolicy
from steadytrain.storage.store import Store
from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

MiB = 1 << 20
SIZE = 5 * MiB + 12345  # six 1 MiB parts, the last one short


def after_first_part(store: Store, action) -> None:
    """Run ``action`` once, right after the first ranged part has come back (the fault lands
    mid-download, whatever the timing)."""
    inner, done = store._call, []

    def call(name, method, *args, **kwargs):
        out = inner(name, method, *args, **kwargs)
        if method == "cat_file" and "start" in kwargs and not done:
            done.append(True)
            action()
        return out

    store._call = call


def leftovers(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_a_large_object_arrives_whole_in_ranged_parts(s3_server, s3_bucket, tmp_path):
    data = os.urandom(SIZE)
    Store(s3_bucket, s3_server.storage_options).write_bytes_atomic("ckpt/big.bin", data)
    ranged = Store(s3_bucket, s3_server.storage_options, part_bytes=MiB, parts_in_flight=4)
    one = Store(s3_bucket, s3_server.storage_options, part_bytes=MiB, parts_in_flight=1)
    for store, dst in ((ranged, tmp_path / "ranged.bin"), (one, tmp_path / "one.bin")):
        store.get_file("ckpt/big.bin", str(dst), durable=False)
        assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(data).digest()
        assert store.stats["bytes_read"] == SIZE
    # Six parts are six GETs (plus the identity checks); one stream is one GET.
    assert ranged.stats["requests"] >= 6 + 2
    assert one.stats["requests"] <= 3
    assert leftovers(str(tmp_path)) == ["one.bin", "ranged.bin"]


def test_a_small_object_is_one_get(s3_server, s3_bucket, tmp_path):
    store = Store(s3_bucket, s3_server.storage_options, part_bytes=MiB, parts_in_flight=8)
    store.write_bytes_atomic("small.bin", b"x" * (2 * MiB - 1))  # under two parts
    store.stats["requests"] = 0
    store.get_file("small.bin", str(tmp_path / "small.bin"))
    assert (tmp_path / "small.bin").read_bytes() == b"x" * (2 * MiB - 1)
    assert store.stats["requests"] <= 3


def test_an_object_rewritten_mid_download_is_never_published(s3_server, s3_bucket, tmp_path):
    writer = Store(s3_bucket, s3_server.storage_options)
    writer.write_bytes_atomic("ckpt/big.bin", os.urandom(SIZE))
    store = Store(s3_bucket, s3_server.storage_options, part_bytes=MiB, parts_in_flight=2)
    after_first_part(store, lambda: writer.write_bytes_atomic("ckpt/big.bin", os.urandom(SIZE)))
    dst = tmp_path / "out" / "big.bin"
    with pytest.raises(StorageError, match="changed while it was downloaded") as err:
        store.get_file("ckpt/big.bin", str(dst))
    assert f"{s3_bucket}/ckpt/big.bin" in str(err.value)
    assert leftovers(str(tmp_path / "out")) == []  # no final name, no temporary either


def test_a_server_killed_mid_download_publishes_nothing(s3_restartable, tmp_path):
    server = s3_restartable
    url = "s3://steady/killed"
    Store(url, server.storage_options).write_bytes_atomic("big.bin", os.urandom(SIZE))
    store = Store(
        url,
        server.storage_options,
        retry=RetryPolicy(request_timeout_s=2, total_s=3, max_backoff_s=0.5),
        part_bytes=MiB,
        parts_in_flight=2,
    )
    after_first_part(store, server.kill)
    dst = tmp_path / "out" / "big.bin"
    with pytest.raises(SteadyError) as err:
        store.get_file("big.bin", str(dst))
    assert f"{url}/big.bin" in str(err.value)  # names what could not be read
    assert leftovers(str(tmp_path / "out")) == []


def test_a_full_disk_is_said_before_any_part_is_fetched(s3_server, s3_bucket, tmp_path):
    store = Store(s3_bucket, s3_server.storage_options, part_bytes=MiB, parts_in_flight=4)
    store.write_bytes_atomic("big.bin", os.urandom(SIZE))
    store.stats["requests"] = 0
    try:
        with tmpfs(tmp_path / "small", "2m") as small:
            dst = os.path.join(small, "big.bin")
            with pytest.raises(StorageError, match="free space there") as err:
                store.get_file("big.bin", dst)
            assert dst in str(err.value) and f"{s3_bucket}/big.bin" in str(err.value)
            assert leftovers(small) == []
    except TmpfsUnavailable as exc:
        pytest.skip(str(exc))
    assert store.stats["requests"] == 1  # the size, then no part: nothing was downloaded
