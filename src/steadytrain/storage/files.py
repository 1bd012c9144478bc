"""Input files addressed by arbitrary URLs: list a file or a directory tree, open one to read.

``Store`` serves a *root* and relative names inside it; ``tokenize`` instead takes a list of
user-given paths and URLs, each a file or a directory. This module is that door, with the
same endpoint and credential resolution (``storage/s3.py``) and the same error messages as
``Store``, so ``s3://…`` inputs honour ``STEADYTRAIN_S3_ENDPOINT`` like everything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import IO, Any

import fsspec

from steadytrain.errors import DatasetError, StorageError
from steadytrain.extras import missing_extra
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


@contextlib.contextmanager
def open_input(url: str, *, compression: str | None = None) -> Iterator[IO[bytes]]:
    """Open an input file for binary reading (``compression="infer"`` decompresses by
    suffix: ``.gz``, ``.zst``, … as fsspec knows them)."""
    _, _, opts = _fs(url)
    try:
        f = fsspec.open(url, "rb", compression=compression, **opts).open()
    except Exception as exc:
        raise _translated(exc, url, opts) from exc
    try:
        yield f
    finally:
        f.close()
