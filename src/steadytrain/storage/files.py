"""Input files addressed by arbitrary URLs: list a file or a directory tree, open one to read.

``Store`` serves a *root* and relative names inside it; ``tokenize`` instead takes a list of
user-given paths and URLs, each a file or a directory. This module is that door, with the
same endpoint and credential resolution (``storage/s3.py``) and the same error messages as
``Store``, so ``s3://…`` inputs honour ``STEADYTRAIN_S3_ENDPOINT`` like everything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Iterator
from typing import IO, Any

import fsspec

from steadytrain.errors import DatasetError, StorageError
from steadytrain.extras import missing_extra, require
from steadytrain.storage.names import backend_module, is_remote_url
from steadytrain.storage.s3 import storage_options_for, translate_error

__all__ = ["InputFile", "list_input", "open_input"]


@dataclasses.dataclass(frozen=True)
class InputFile:
    """A file found under an input: its URL (or local path), path relative to the input
    (``""`` for a file given directly), size and mtime."""

    url: str
    rel: str
    size: int
    mtime: float


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0.0)))
    try:
        return float(value)
    except (TypeError, ValueError):
        return float(value.timestamp()) if hasattr(value, "timestamp") else 0.0


def _fs(url: str) -> tuple[Any, str, dict[str, Any]]:
    opts = storage_options_for(url, None)
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except ImportError as exc:
        raise missing_extra(backend_module(url), f"reading {url!r}") from exc
    except (ValueError, TypeError) as exc:
        raise StorageError(f"cannot open {url!r}: {exc}; check the URL scheme") from exc
    return fs, root, opts


def _translated(exc: Exception, url: str, opts: dict[str, Any]) -> Exception:
    return translate_error(exc, what=url, url=url, storage_options=opts) or exc


def list_input(url: str) -> tuple[bool, list[InputFile]]:
    """(is_directory, files): every file below a directory (sorted by path, so the order is
    the same on every machine), or the one file ``url`` names."""
    fs, root, opts = _fs(url)
    proto = url.split("://", 1)[0] + "://" if is_remote_url(url) else ""
    try:
        if not fs.exists(root):
            raise DatasetError(f"input {url} does not exist; check the path")
        if not fs.isdir(root):
            info = fs.info(root)
            return False, [InputFile(url if proto else root, "", int(info["size"]), _mtime(info))]
        found = fs.find(root, detail=True, withdirs=False)
    except (DatasetError, StorageError):
        raise
    except Exception as exc:
        raise _translated(exc, url, opts) from exc
    prefix = root.rstrip("/") + "/"
    out = []
    for path in sorted(found):
        rel = path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]
        info = found[path]
        out.append(InputFile(proto + path if proto else path, rel, int(info["size"]), _mtime(info)))
    return True, out


# Suffixes read through zstandard when ``compression="infer"``. fsspec infers ``.zst`` only
# when a zstd module happened to import, and its zstandard reader stops after the first frame
# and returns a truncated stream as a clean EOF; this module owns the zstd path instead.
ZSTD_SUFFIXES = (".zst", ".zstd")
_ZSTD_CHUNK = 1 << 20


class _ZstdReader(io.RawIOBase):
    """Decompress every frame of a zstd stream; a stream that ends inside a frame (a
    truncated upload or download) or holds no frame at all raises ``DatasetError`` naming
    the file, instead of ending early as if the data were complete."""

    def __init__(self, raw: IO[bytes], url: str, zstd: Any) -> None:
        super().__init__()
        self._raw, self._url, self._zstd = raw, url, zstd
        self._dctx = zstd.ZstdDecompressor()
        self._frame: Any = None  # decompressobj of the frame in progress
        self._frames = 0
        self._buf = b""
        self._pos = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self._pos >= len(self._buf) and not self._done:
            self._fill()
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def _fill(self) -> None:
        self._buf, self._pos = b"", 0
        chunk = self._raw.read(_ZSTD_CHUNK)
        if not chunk:
            if self._frame is not None or self._frames == 0:
                where = "ends inside a frame" if self._frame is not None else "holds no frame"
                raise DatasetError(
                    f"{self._url}: truncated zstd stream (it {where}); the file is incomplete: "
                    f"copy or re-compress it again (`zstd -t FILE` checks it)"
                )
            self._done = True
            return
        out = []
        while chunk:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            try:
                out.append(self._frame.decompress(chunk))
            except self._zstd.ZstdError as exc:
                raise DatasetError(
                    f"{self._url}: not a valid zstd stream ({exc}); check that the file is "
                    f"zstd-compressed (`zstd -t FILE`) or rename it without the .zst suffix"
                ) from None
            if self._frame.eof:  # a frame ended: the rest of the chunk starts the next one
                chunk, self._frame = self._frame.unused_data, None
                self._frames += 1
            else:
                chunk = b""
        self._buf = b"".join(out)

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def _is_zstd(url: str, compression: str | None) -> bool:
    if compression in ("zstd", "zst"):
        return True
    return compression == "infer" and url.lower().endswith(ZSTD_SUFFIXES)


@contextlib.contextmanager
def open_input(url: str, *, compression: str | None = None) -> Iterator[IO[bytes]]:
    """Open an input file for binary reading (``compression="infer"`` decompresses by
    suffix: ``.gz``, ``.bz2``, ``.xz`` as fsspec knows them, ``.zst`` through zstandard,
    which is the ``[zstd]`` extra)."""
    _, _, opts = _fs(url)
    zstd = None
    if _is_zstd(url, compression):
        zstd = require("zstandard", f"reading the zstd-compressed file {url}")
        compression = None
    try:
        f = fsspec.open(url, "rb", compression=compression, **opts).open()
    except Exception as exc:
        raise _translated(exc, url, opts) from exc
    if zstd is not None:
        f = io.BufferedReader(_ZstdReader(f, url, zstd), buffer_size=_ZSTD_CHUNK)
    try:
        yield f
    finally:
        f.close()
