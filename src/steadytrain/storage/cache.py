"""``ShardCache``: a node-local copy of a remote dataset, shared by every process of the node.

The cache knows files, not datasets: it is given *units* (a shard's token file and index
file are one unit, fetched and evicted together), each a list of ``FileSpec`` (name, size,
checksum), and a *namespace* (the data side passes the dataset fingerprint). Layout under
``cache_dir`` (one sub-directory per namespace, so two datasets, or a re-tokenized one,
never mix)::

    <namespace>/shards/shard-00000.tokens     published files, same relative names as remote
    <namespace>/.state/<quoted name>.lock     fcntl.flock target, one per file
    <namespace>/.state/<quoted name>.ok       stamp: "size mtime_ns inode checksum"
    <namespace>/.tmp/<quoted name>@<pid>@<rand>.part   downloads in progress

Protocol for one file (``local_path``):

1. Published and already checked by this process: a hit, no system call but ``stat``.
2. Otherwise take the file's ``flock`` (blocking; the kernel drops it if the holder dies,
   so a crash never leaves a stale lock), then look again: another rank or worker may have
   published it while we waited. A published file is trusted when its size, mtime and inode
   match its stamp (cheap); otherwise, or with ``verify="checksum"``, it is checksummed and
   re-fetched on mismatch (a corrupted or replaced cache file is never used).
3. Missing: download into ``.tmp`` in ranged chunks (each retried under the store's
   deadline), checksum while streaming, ``fsync``, ``rename`` into place, write the stamp,
   release the lock. A crash mid-download leaves only a ``.part`` file, which is never read
   and is swept by the next ``ShardCache`` (when no process holds its lock).

A full disk raises ``StorageError`` naming the cache directory, the bytes needed and free;
the partial file is removed and published files are untouched.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote, unquote

import numpy as np

from steadytrain.errors import ConfigError, DatasetError, StorageError
from steadytrain.storage.publish import (
    StreamingChecksum,
    file_checksum,
    publish_bytes,
    publish_file,
)
from steadytrain.storage.regular import open_regular_fd
from steadytrain.storage.store import Store, safe_relpath

__all__ = ["ShardCache", "FileSpec", "file_checksum"]

VERIFY_MODES = ("stamp", "checksum", "size")


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """One file the cache may hold: its relative name, byte size and ``xxh3_64:`` checksum."""

    name: str
    size: int
    checksum: str


class ShardCache:
    """Fetch-once, verified, atomically published node-local copies of dataset files.

    ``verify``: ``"stamp"`` (default) trusts a published file whose size/mtime/inode match
    the stamp written when it was fetched and checksums it otherwise; ``"checksum"``
    checksums every file the first time each process uses it; ``"size"`` checks sizes only.
    """

    def __init__(
        self,
        cache_dir: str,
        store: Store,
        units: Sequence[Sequence[FileSpec]],
        namespace: str,
        *,
        verify: str = "stamp",
        chunk_bytes: int = 8 << 20,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify={verify!r} is not one of {VERIFY_MODES}")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
        self.store = store
        self.units = [tuple(u) for u in units]
        self.namespace = safe_relpath(namespace, what="cache namespace")
        self.verify = verify
        self.chunk_bytes = chunk_bytes
        self.root = os.path.join(self.cache_dir, self.namespace)
        self._state = os.path.join(self.root, ".state")
        self._tmp = os.path.join(self.root, ".tmp")
        try:
            for d in (self._state, self._tmp):
                os.makedirs(d, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create cache directory {self.root}: {exc}; pass a writable, "
                f"node-local cache_dir"
            ) from exc
        self._checked: set[str] = set()  # names this process has verified
        self._mutex = threading.Lock()
        self._m: dict[str, float] = collections.defaultdict(float)
        self._lat: collections.deque[float] = collections.deque(maxlen=4096)
        self._stats_prev: dict[str, int] = {}
        self.prefetch_ahead_steps: int | None = None  # set by the prefetcher
        self.sweep_stale_tmp()

    def __repr__(self) -> str:
        return f"ShardCache({self.root!r}, store={self.store.url!r})"

    # -- paths and locks ---------------------------------------------------------------
    def path(self, name: str) -> str:
        return os.path.join(self.root, safe_relpath(name))

    def _quoted(self, name: str) -> str:
        return quote(name, safe="")

    @contextlib.contextmanager
    def _flock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        fd = os.open(
            os.path.join(self._state, self._quoted(name) + ".lock"), os.O_RDWR | os.O_CREAT, 0o644
        )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def sweep_stale_tmp(self) -> int:
        """Remove ``.part`` files no live download owns (its lock is free). Returns count."""
        removed = 0
        for entry in os.listdir(self._tmp):
            name = unquote(entry.split("@", 1)[0])
            with self._flock(name, blocking=False) as got:
                if got:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self._tmp, entry))
                        removed += 1
        return removed

    # -- stamps ------------------------------------------------------------------------
    def _stamp_path(self, name: str) -> str:
        return os.path.join(self._state, self._quoted(name) + ".ok")

    def _write_stamp(self, name: str, checksum: str) -> None:
        st = os.stat(self.path(name))
        try:
            # Not durable: a stamp lost to a power cut only costs one checksum pass.
            publish_bytes(
                self._stamp_path(name),
                f"{st.st_size} {st.st_mtime_ns} {st.st_ino} {checksum}\n",
                durable=False,
            )
        except OSError:
            # The stamp only saves a checksum pass: without it the file is checksummed on
            # next use, which is correct, just slower. Never fail a fetch over it.
            self._count(stamp_failures=1)

    def _stamp_matches(self, name: str, st: os.stat_result, checksum: str) -> bool:
        """Does the stamp vouch for this file? The stamp is untrusted (any process or person
        can write the cache directory): anything but a small regular file holding four
        well-formed fields is no stamp, and the file is checksummed (and the stamp
        rewritten, or the entry re-fetched) instead. Never raises, never blocks."""
        stamp = self._stamp_path(name)
        text = _read_small_regular(stamp, _STAMP_MAX_BYTES)
        if text is None:
            if os.path.lexists(stamp):  # there, but a link, FIFO, directory or oversized
                self._count(bad_stamps=1)
            return False
        fields = text.split()
        if len(fields) != 4 or not all(f.isascii() and f.isdigit() for f in fields[:3]):
            self._count(bad_stamps=1)
            return False
        size, mtime, ino = (int(f) for f in fields[:3])
        return (size, mtime, ino, fields[3]) == (
            st.st_size,
            st.st_mtime_ns,
            st.st_ino,
            checksum,
        )

    def _published_ok(self, name: str, size: int, checksum: str) -> bool:
        """Is the published copy present and sound? (Caller holds the lock or is checking.)"""
        path = self.path(name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        # Only a regular file of ours is a published copy: a link (it may lead anywhere), a
        # FIFO (a checksum pass would block on it) or a directory is replaced by a fetch.
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        if self.verify == "size":
            return True
        if self.verify == "stamp" and self._stamp_matches(name, st, checksum):
            return True
        if file_checksum(path) != checksum:
            return False
        self._write_stamp(name, checksum)
        return True

    # -- the resolver TokenDataset calls -----------------------------------------------
    def local_path(self, name: str, size: int, checksum: str) -> str:
        """The verified local copy of ``name``, fetched first if needed (blocking)."""
        t0 = time.perf_counter()
        path = self.path(name)
        if name in self._checked and _size_is(path, size):
            self._count(hits=1)
            return path
        fetched, waited = self._ensure(name, size, checksum)
        waited_s = time.perf_counter() - t0
        self._count(**({"misses": 1, "wait_s": waited_s} if (fetched or waited) else {"hits": 1}))
        return path

    def is_cached(self, name: str, size: int) -> bool:
        """Cheap presence test (size only) used by the prefetcher and preflight."""
        return _size_is(self.path(name), size)

    def fetch(self, name: str, size: int, checksum: str) -> bool:
        """Make sure ``name`` is published (the prefetcher's entry). True if we downloaded it."""
        fetched, _ = self._ensure(name, size, checksum)
        return fetched

    @property
    def num_shards(self) -> int:
        return len(self.units)

    def shard_files(self, shard: int) -> list[tuple[str, int, str]]:
        """The (name, size, checksum) of every file of unit ``shard``."""
        return [(f.name, f.size, f.checksum) for f in self.units[shard]]

    def shard_bytes(self, shard: int) -> int:
        return sum(f.size for f in self.units[shard])

    def ensure_shard(self, shard: int) -> int:
        """Fetch both files of a shard; returns bytes downloaded by this call."""
        got = 0
        for name, size, cs in self.shard_files(shard):
            if self.fetch(name, size, cs):
                got += size
        return got

    def shard_cached(self, shard: int) -> bool:
        return all(self.is_cached(n, size) for n, size, _ in self.shard_files(shard))

    def evict_shard(self, shard: int) -> int:
        """Remove a shard's files; open memory maps stay valid (POSIX unlink). Returns bytes."""
        freed = 0
        for name, size, _ in self.shard_files(shard):
            with self._flock(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._stamp_path(name))
                try:
                    os.unlink(self.path(name))
                    freed += size
                except FileNotFoundError:
                    pass
            with self._mutex:
                self._checked.discard(name)
        self._count(evictions=1, evicted_bytes=freed)
        return freed

    def usage_bytes(self) -> int:
        """Bytes of published shard files of this dataset in the cache."""
        return sum(self.shard_bytes(i) for i in range(self.num_shards) if self.shard_cached(i))

    # -- fetching ----------------------------------------------------------------------
    def _ensure(self, name: str, size: int, checksum: str) -> tuple[bool, bool]:
        """(downloaded, waited): publish ``name`` unless a sound copy is there."""
        path = self.path(name)
        if _size_is(path, size) and (
            name in self._checked or self._published_ok(name, size, checksum)
        ):
            return False, False
        with self._flock(name):
            # Re-check under the lock: another process may have published it meanwhile.
            if self._published_ok(name, size, checksum):
                result = (False, True)
            else:
                if os.path.lexists(path):
                    self._count(corrupt_refetches=1)
                    _remove_entry(path)
                self._download(name, size, checksum)
                result = (True, True)
        with self._mutex:
            self._checked.add(name)
        return result

    def _download(self, name: str, size: int, checksum: str) -> None:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._check_space(name, size)
        tmp = os.path.join(
            self._tmp, f"{self._quoted(name)}@{os.getpid()}@{uuid.uuid4().hex[:8]}.part"
        )
        for attempt in range(2):  # one re-fetch if the bytes do not match the manifest
            try:
                got = self._download_to(name, size, tmp)
            except OSError as exc:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._space_error(name, size) from exc
                raise StorageError(f"cache {self.root}: cannot write {name}: {exc}") from exc
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            if got == checksum:
                break
            os.unlink(tmp)
            if attempt == 1:
                raise DatasetError(
                    f"{self.store.display(name)}: checksum {got} does not match the manifest "
                    f"({checksum}) on two downloads: the remote file is damaged; run "
                    f"`steadytrain verify {self.store.url}` and restore or re-tokenize it"
                )
        publish_file(tmp, path)
        self._write_stamp(name, checksum)
        self._count(downloads=1, bytes_fetched=size)

    def _download_to(self, name: str, size: int, tmp: str) -> str:
        h = StreamingChecksum()
        with open(tmp, "wb") as f:
            for start in range(0, size, self.chunk_bytes):
                end = min(size, start + self.chunk_bytes)
                t0 = time.perf_counter()
                data = self.store.read_bytes(name, start, end)
                with self._mutex:
                    self._lat.append(time.perf_counter() - t0)
                if len(data) != end - start:
                    raise DatasetError(
                        f"{self.store.display(name)}: got {len(data)} bytes for [{start}, {end}); "
                        f"the remote file is shorter than the manifest says ({size})"
                    )
                f.write(data)
                h.update(data)
        return h.hexdigest()  # publish_file fsyncs it before the rename

    def _check_space(self, name: str, size: int) -> None:
        if shutil.disk_usage(self.root).free < size:
            raise self._space_error(name, size)

    def _space_error(self, name: str, size: int) -> StorageError:
        free = shutil.disk_usage(self.root).free
        return StorageError(
            f"cache directory {self.cache_dir} is full: {name} needs {size} bytes, "
            f"{free} are free; free space there, point cache_dir at a larger disk, or set a "
            f"cache byte budget (prefetch budget_bytes) so old shards are evicted"
        )

    # -- metrics -----------------------------------------------------------------------
    def _count(self, **deltas: float) -> None:
        with self._mutex:
            for k, v in deltas.items():
                self._m[k] += v

    def stats(self) -> dict[str, int]:
        """``hits``/``misses``/``downloads``/``bytes_fetched`` since the previous ``stats()``
        call (the loader's per-step ``metrics()`` sums these over its datasets)."""
        with self._mutex:
            now = {k: int(self._m[k]) for k in ("hits", "misses", "downloads", "bytes_fetched")}
            prev, self._stats_prev = self._stats_prev, now
        return {k: v - prev.get(k, 0) for k, v in now.items()}

    def metrics(self, reset: bool = False) -> dict[str, Any]:
        """Counters for the ledger: since the start, or since the last ``reset=True`` call."""
        with self._mutex:
            lat = np.array(self._lat) if self._lat else None
            out: dict[str, Any] = {
                "cache_hits": int(self._m["hits"]),
                "cache_misses": int(self._m["misses"]),
                "downloads": int(self._m["downloads"]),
                "bytes_fetched": int(self._m["bytes_fetched"]),
                "cache_wait_s": float(self._m["wait_s"]),
                "evictions": int(self._m["evictions"]),
                "evicted_bytes": int(self._m["evicted_bytes"]),
                "corrupt_refetches": int(self._m["corrupt_refetches"]),
                # stamps that were not a small file of four fields (skipped: checksummed)
                "bad_stamps": int(self._m["bad_stamps"]),
                "remote_retries": int(self.store.stats["retries"]),
                "read_p50_s": float(np.percentile(lat, 50)) if lat is not None else None,
                "read_p99_s": float(np.percentile(lat, 99)) if lat is not None else None,
                "prefetch_ahead_steps": self.prefetch_ahead_steps,
            }
            if reset:
                self._m.clear()
                self._lat.clear()
                self._stats_prev = {}
        return out


_STAMP_MAX_BYTES = 256  # "size mtime_ns inode xxh3_64:<16 hex>\n" is under 100 bytes


def _read_small_regular(path: str, limit: int) -> str | None:
    """The text of ``path`` if it is a regular file (not a link) of at most ``limit`` bytes
    holding ASCII, else None. Opened non-blocking and without following links, so a FIFO or
    a link to /dev/zero planted in its place costs one system call, not a hang."""
    try:
        fd = open_regular_fd(path, follow_links=False)
    except OSError:  # missing, a link (ELOOP), a FIFO or device, unreadable
        return None
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > limit:
        return None
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        return None


def _remove_entry(path: str) -> None:
    """Remove whatever occupies a cache entry's path (a damaged file, a link, a FIFO, a
    directory) so the fetch can publish the real file there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _size_is(path: str, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False
