"""Parsing the inside of a DCP shard file without copying it.

DCP writes each tensor as a small ``torch.save`` zip archive inside a ``.distcp`` file. To
move a tensor's bytes straight from disk into the live tensor, ``reader.VerifyingReader``
needs the archive's layout (where the raw storage bytes sit, which dtype and shape they
have); this module finds it from the archive's two ends, with the weights-only unpickler.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import sys
import zipfile
from collections.abc import Iterable
from typing import Any

import torch

from steadytrain.checkpoint.torch_private import (
    TorchAPIError,
    typed_storage,
    unpickle_weights_only,
)
from steadytrain.errors import CheckpointError

__all__ = ["HEADERS", "tensor_layout", "pread_exact", "narrow", "dest_bytes"]

HEADERS = 16 << 10  # bytes read at each end of a tensor's archive to parse it
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header (30 bytes)


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``base`` of an open file (pread)."""

    def __init__(self, fd: int, base: int, length: int, cache: int = 0) -> None:
        super().__init__()
        self._fd, self._base, self._len, self._pos = fd, base, length, 0
        # ``cache``: read the first and last ``cache`` bytes once (a torch.save archive's
        # headers and pickle sit at its start, the zip directory at its end): two reads per
        # tensor instead of ~a dozen small ones, which matters when the file is cold.
        self._cached: list[tuple[int, bytes]] = []
        if cache:
            head = min(length, cache)
            self._cached.append((0, self._pread(0, head)))
            if length > head:
                tail = max(head, length - cache)
                self._cached.append((tail, self._pread(tail, length - tail)))

    def _pread(self, pos: int, n: int) -> bytes:
        buf = bytearray(n)
        pread_exact(self._fd, memoryview(buf), self._base + pos, "torch.save archive")
        return bytes(buf)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, start + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        if n == 0:
            return 0
        for at, data in self._cached:
            if at <= self._pos and self._pos + n <= at + len(data):
                memoryview(b).cast("B")[:n] = data[self._pos - at : self._pos - at + n]
                self._pos += n
                return n
        got = os.preadv(self._fd, [memoryview(b).cast("B")[:n]], self._base + self._pos)
        self._pos += got
        return got


def pread_exact(fd: int, mv: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{what}: unexpected end of file at byte {offset + done}")
        done += n


@functools.lru_cache(maxsize=4096)
def _unpickle_meta(pkl: bytes) -> Any:
    """Same-shaped tensors have byte-identical pickles (a model's layers): unpickle once."""

    def persistent_load(saved_id: Any) -> Any:
        kind, storage_type, _key, _location, numel = saved_id
        if kind not in ("storage", b"storage"):
            raise ValueError(f"persistent id {kind!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        return typed_storage(storage, dtype)

    return unpickle_weights_only(pkl, persistent_load)


def _meta_tensor(pkl: bytes, window: _Window) -> Any:
    """The tensor described by a ``torch.save`` pickle, on the ``meta`` device (no data).

    Uses torch's weights-only unpickler (what ``torch.load(weights_only=True)`` uses) with
    storages created on ``meta``: ~10x cheaper per tensor than ``torch.load`` on a file-like,
    which matters for checkpoints with thousands of tensors. Any surprise (another torch
    version, another pickle shape) falls back to ``torch.load(map_location="meta")``, except
    a private torch API that is gone (``torch_private``): that is said loudly, not hidden.
    """
    try:
        return _unpickle_meta(pkl)
    except TorchAPIError:
        raise
    except Exception:  # noqa: BLE001 - the public path below is always right, only slower
        window.seek(0)
        return torch.load(window, map_location="meta", weights_only=True)


def tensor_layout(fd: int, base: int, length: int) -> tuple[Any, int] | None:
    """(meta tensor with the saved layout, file offset of its storage bytes), or None.

    None means "use DCP's normal path": anything but one storage, stored uncompressed, in
    this host's byte order, in a ``torch.save`` zip archive (DCP then reports real damage).
    """
    try:
        return _parse_archive(fd, base, length)
    except (zipfile.BadZipFile, ValueError, KeyError, EOFError, struct.error):
        return None


def _parse_archive(fd: int, base: int, length: int) -> tuple[Any, int] | None:
    window = _Window(fd, base, length, cache=HEADERS)
    zf = zipfile.ZipFile(window)
    infos = zf.infolist()
    if not infos:
        return None
    prefix = infos[0].filename.split("/", 1)[0]
    data = [i for i in infos if i.filename.startswith(f"{prefix}/data/")]
    names = {i.filename for i in infos}
    if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
        return None
    if f"{prefix}/data.pkl" not in names:
        return None
    if f"{prefix}/byteorder" in names:
        order = _member(zf, window, f"{prefix}/byteorder", length)
        if order is None or order.decode() != sys.byteorder:
            return None
    elif sys.byteorder != "little":  # archives without the record are little-endian
        return None
    info = data[0]
    offset = _stored_offset(window, info, length)
    pkl = _member(zf, window, f"{prefix}/data.pkl", length)
    if offset is None or pkl is None:
        return None
    meta = _meta_tensor(pkl, window)
    if type(meta) is not torch.Tensor or meta.layout != torch.strided or meta.is_quantized:
        return None
    if meta.device.type != "meta" or meta.untyped_storage().nbytes() != info.file_size:
        return None
    return meta, base + offset


def _stored_offset(window: _Window, info: zipfile.ZipInfo, length: int) -> int | None:
    """Where an uncompressed member's bytes start in the archive (after its local header)."""
    window.seek(info.header_offset)
    head = window.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        return None
    sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if sig != 0x04034B50:
        return None
    offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return offset if offset + info.file_size <= length else None


def _member(zf: zipfile.ZipFile, window: _Window, name: str, length: int) -> bytes | None:
    """A small member's bytes, read at its offset rather than through ``zf.read``: our
    writer saves without zip CRC-32 (``hashing_writer.py``), so members carry CRC 0, which
    ``zipfile`` refuses; COMMIT's xxh3-64 covers these bytes instead."""
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    offset = _stored_offset(window, info, length)
    if offset is None:
        return None
    window.seek(offset)
    data = window.read(info.file_size)
    return data if len(data) == info.file_size else None


def narrow(t: Any, offsets: Iterable[int], lengths: Iterable[int]) -> Any:
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or n != t.size(dim):
            t = t.narrow(dim, off, n)
    return t


def dest_bytes(target: Any) -> memoryview | None:
    """A writable byte view of a CPU tensor's memory, or None when it has none to offer."""
    if type(target) is not torch.Tensor or target.device.type != "cpu" or target.numel() == 0:
        return None
    if not target.is_contiguous() or target.is_conj() or target.is_neg():
        return None
    try:
        return memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
    except (RuntimeError, TypeError, ValueError):
        return None
