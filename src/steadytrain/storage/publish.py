"""The one way a local file becomes visible, and the one way bytes are hashed.

DESIGN invariant 3 (nothing is visible before it is complete) is kept here and nowhere else:

1. write to a temporary name in the destination's own directory (same file system, so the
   rename is atomic; a hidden ``.NAME.tmp-…`` name that no reader or listing matches);
2. ``fsync`` the file, so its bytes are on disk before its name is;
3. ``os.replace`` it onto the final name (readers see the old file or the new one);
4. ``fsync`` the directory, so the rename itself survives a power loss.

On any error the temporary file is removed and the final name is untouched. ``durable=False``
skips both fsyncs for files whose loss on power failure costs only a recomputation (cache
stamps, a report that ``steadytrain report`` rebuilds); the rename stays atomic.

A whole directory (a new dataset) is published the same way by ``publish_dir``: built under a
``temp_name`` sibling, renamed into place once, never over a directory that holds anything.
``publish_new_dir`` never replaces anything, not even an empty directory (an export's
destination that someone else created meanwhile).

Checksums are xxh3-64, written ``xxh3_64:<16 hex digits>`` (the dataset manifest's notation);
COMMIT files store the bare hex digest (``digest_bytes``, ``file_digest``,
``Hasher.digest_hex``). ``Hasher`` is the one streaming hasher; ``atomic_writer`` can hash what
it writes as it writes it. (xxh3-128 *fingerprints* of settings are identities, not checksums
of stored bytes, and stay with their owners.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import IO, Any

import xxhash

__all__ = [
    "CHECKSUM_ALGO",
    "Hasher",
    "StreamingChecksum",
    "canonical_digest",
    "checksum_bytes",
    "digest_bytes",
    "file_checksum",
    "file_digest",
    "fsync_dir",
    "atomic_writer",
    "publish_bytes",
    "publish_bytes_if_absent",
    "publish_file",
    "publish_dir",
    "publish_new_dir",
    "temp_name",
]

CHECKSUM_ALGO = "xxh3_64"
_CHUNK = 8 << 20


class Hasher:
    """Streaming xxh3-64: ``update`` with pieces (any buffer: bytes, memoryview, a contiguous
    numpy array), then ``digest_hex`` (bare hex, COMMIT's notation) or ``hexdigest``
    (``xxh3_64:<hex>``, the manifest's). ``size`` counts the bytes seen."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.size = 0
        # xxhash's own update, for a caller that counts the bytes itself (``size`` stays 0)
        self.update_unsized = self._h.update

    def update(self, data: Any) -> None:
        self._h.update(data)
        self.size += memoryview(data).nbytes

    def digest_hex(self) -> str:
        return self._h.hexdigest()

    def hexdigest(self) -> str:
        """The manifest notation, ``xxh3_64:<hex>`` (kept for ``StreamingChecksum`` users)."""
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"


# The name the dataset format has always used for a streaming manifest checksum.
StreamingChecksum = Hasher


def digest_bytes(data: Any) -> str:
    """Bare xxh3-64 hex of a buffer (COMMIT's notation)."""
    return xxhash.xxh3_64_hexdigest(data)


def canonical_digest(obj: Any) -> str:
    """xxh3-128 hex of ``obj`` as canonical JSON (sorted keys, no spaces): the identity of a
    small structure (a dataset fingerprint, a tokenize recipe). Changing the serialisation
    would change every fingerprint on disk, so it is fixed here, once."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def checksum_bytes(data: Any) -> str:
    """``xxh3_64:<hex>`` of a buffer (the manifest's notation)."""
    return f"{CHECKSUM_ALGO}:{digest_bytes(data)}"


def file_digest(path: str, *, chunk: int = _CHUNK) -> tuple[int, str]:
    """(size, bare xxh3-64 hex) of a local file, read in ``chunk``-byte pieces."""
    h = Hasher()
    with open(path, "rb") as f:
        while piece := f.read(chunk):
            h.update(piece)
    return h.size, h.digest_hex()


def file_checksum(path: str) -> str:
    """``xxh3_64:<hex>`` of a local file."""
    return f"{CHECKSUM_ALGO}:{file_digest(path)[1]}"


def fsync_dir(path: str) -> None:
    """Make a rename (or a create, or an unlink) in ``path`` durable.

    A file system that cannot fsync a directory at all (some FUSE and network mounts answer
    EINVAL or ENOTSUP) gives renames only the durability it has; that is not an error here,
    or every publish on it would fail. Any other failure (EIO, a missing directory) raises.
    """
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def temp_name(final: str) -> str:
    """A hidden, unique temporary name beside ``final`` (same directory, same file system)."""
    directory, base = os.path.split(final)
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def publish_file(tmp: str, final: str, *, durable: bool = True) -> None:
    """Rename a finished temporary file onto ``final`` (fsync'ing file and directory first
    when ``durable``). The caller wrote ``tmp``; on error ``tmp`` is removed."""
    try:
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(final))


class _HashingWriter:
    """A binary file wrapper that hashes every byte written through it."""

    def __init__(self, f: IO[bytes], hasher: Hasher) -> None:
        self._f = f
        self.hasher = hasher

    def write(self, data: Any) -> int:
        self.hasher.update(data)
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def atomic_writer(
    final: str, mode: str = "wb", *, durable: bool = True, hasher: Hasher | None = None
) -> Iterator[Any]:
    """``with atomic_writer(path) as f: f.write(...)`` publishes ``path`` whole or not at all.

    ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8). With ``hasher`` (binary mode only) every
    byte written is hashed on the way. The parent directory is created if missing.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_writer mode {mode!r}: use 'wb' or 'w'")
    if hasher is not None and mode != "wb":
        raise ValueError("atomic_writer: hashing needs binary mode 'wb'")
    directory = os.path.dirname(final)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = temp_name(final)
    try:
        with open(tmp, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield _HashingWriter(f, hasher) if hasher is not None else f
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    publish_file(tmp, final, durable=durable)


def publish_bytes(final: str, data: bytes | str, *, durable: bool = True) -> None:
    """Publish ``data`` as ``final`` atomically (text is written as UTF-8)."""
    with atomic_writer(final, "w" if isinstance(data, str) else "wb", durable=durable) as f:
        f.write(data)


def publish_dir(tmp_dir: str, final_dir: str, *, durable: bool = True) -> None:
    """Rename a finished directory (built at ``temp_name(final_dir)``) onto ``final_dir``.

    ``final_dir`` must be missing or empty: renaming a directory onto an empty one is atomic
    (POSIX), onto one that holds anything fails, so a directory is never overwritten in place
    (``FileExistsError`` naming ``final_dir``). On any error ``tmp_dir`` is left as it is: it holds
    finished work, and the caller decides whether to keep it (and say where) or remove it.
    Files inside ``tmp_dir`` were published with their own fsyncs; ``durable`` fsyncs the
    directory's own entries before the rename and its parent after it.
    """
    if durable:
        fsync_dir(tmp_dir)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            # The standard OSError shape (errno, strerror, filename): callers word the fix.
            raise FileExistsError(exc.errno, os.strerror(exc.errno), final_dir) from None
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


def publish_new_dir(tmp_dir: str, final_dir: str, *, durable: bool = True) -> None:
    """Rename the finished ``tmp_dir`` onto ``final_dir`` only if nothing has that name.

    ``publish_dir`` replaces an empty directory (atomically: right for a destination its
    caller made); this one never does: a directory that appeared while the work was being
    built is someone else's, and ``FileExistsError`` names it. Linux's
    ``renameat2(RENAME_NOREPLACE)`` checks and renames in one step; where it is missing
    (another system, a file system without it) the name is checked just before the rename,
    which leaves an instant in which an empty directory made right then is still replaced.
    ``tmp_dir`` is left as it is on any error, as ``publish_dir`` leaves it.
    """
    if durable:
        fsync_dir(tmp_dir)
    if not _rename_noreplace(tmp_dir, final_dir):
        if os.path.lexists(final_dir):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), final_dir)
        publish_dir(tmp_dir, final_dir, durable=False)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(final_dir)))


def _rename_noreplace(src: str, dst: str) -> bool:
    """``renameat2(src, dst, RENAME_NOREPLACE)``: True when renamed, False when this system
    or file system cannot do it (the caller falls back); ``FileExistsError`` when ``dst``
    exists, any other ``OSError`` as the kernel gives it."""
    call = _renameat2()
    if call is None:
        return False
    at_fdcwd, noreplace = -100, 1  # <fcntl.h>, <linux/fs.h>
    if call(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # no such flag here: fall back
        return False
    raise OSError(err, os.strerror(err), dst)  # EEXIST makes it a FileExistsError


@functools.cache
def _renameat2() -> Any:
    """glibc's ``renameat2`` (2.28 and later) through ctypes, or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


def publish_bytes_if_absent(final: str, data: bytes) -> bool:
    """Create ``final`` holding ``data`` only if nothing has that name; True when this call
    created it. A finished, fsync'd temporary file is hard-linked onto the name (``link``
    fails if the name exists), so readers never see a partial file and exactly one of two
    racing writers wins (a claim or a lease). Needs a file system with hard links."""
    directory = os.path.dirname(final)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = temp_name(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, final)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(directory)
    return True
