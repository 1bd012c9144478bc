"""The one way a local file becomes visible, and the one way bytes are hashed.

DESIGN invariant 3 (nothing is visible before it is complete) is kept here and nowhere else:

1. write to a temporary name in the destination's own directory (same file system, so the
   rename is atomic; a hidden ``.NAME.tmp-…`` name that no reader or listing matches);
2. ``fsync`` the file, so its bytes are on disk before its name is;
3. ``os.replace`` it onto the final name (readers see the old file or the new one);
4. ``fsync`` the directory, so the rename itself survives a power loss.

On any error the temporary file is removed and the final name is untouched. ``durable=False``
skips both fsyncs for files whose loss on power failure costs only a recomputation (cache
stamps, a ledger snapshot that is rebuilt from the ledger); the rename stays atomic.

Checksums are xxh3-64, written ``xxh3_64:<16 hex digits>`` (the dataset manifest's notation);
COMMIT files store the bare hex digest. ``Hasher`` is the one streaming hasher; ``publish``
and ``atomic_writer`` can hash what they write as they write it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

import xxhash

__all__ = [
    "CHECKSUM_ALGO",
    "Hasher",
    "StreamingChecksum",
    "checksum_bytes",
    "file_checksum",
    "file_digest",
    "fsync_dir",
    "atomic_writer",
    "publish_bytes",
    "publish_file",
    "temp_name",
]

CHECKSUM_ALGO = "xxh3_64"
_CHUNK = 8 << 20


class Hasher:
    """Streaming xxh3-64: ``update`` with pieces, then ``hexdigest`` (bare) or ``checksum``
    (``xxh3_64:<hex>``)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self.size = 0

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


def checksum_bytes(data: Any) -> str:
    """``xxh3_64:<hex>`` of a buffer."""
    return f"{CHECKSUM_ALGO}:{xxhash.xxh3_64_hexdigest(data)}"


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
    """Make a rename (or a create, or an unlink) in ``path`` durable."""
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
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
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)


def publish_bytes(final: str, data: bytes | str, *, durable: bool = True) -> None:
    """Publish ``data`` as ``final`` atomically (text is written as UTF-8)."""
    with atomic_writer(final, "w" if isinstance(data, str) else "wb", durable=durable) as f:
        f.write(data)
