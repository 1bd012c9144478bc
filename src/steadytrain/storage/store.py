"""Access to a directory-like root addressed by a local path or an fsspec URL.

Everything above this module speaks in *relative names* inside a root ("shards/x.tokens"),
never in ``pathlib.Path`` (which would mangle ``s3://``). Publishing is atomic: a local file
is written under a temporary name and renamed; an object-store upload only becomes visible
when the (multipart) PUT completes, and is discarded on error.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec

from steadytrain.errors import StorageError

__all__ = ["Store", "safe_relpath", "is_remote_url"]


def is_remote_url(url: str) -> bool:
    """True for URLs that need a network filesystem (``s3://``, ``gs://``...)."""
    return "://" in url and not url.startswith("file://")


def safe_relpath(name: str, *, what: str = "path") -> str:
    """Return ``name`` normalised, refusing anything that escapes its root.

    Manifests and COMMIT files come from storage we may not control; a name like
    ``../../etc/passwd`` or ``/abs`` must never be opened relative to a dataset root.
    """
    if not isinstance(name, str) or not name:
        raise StorageError(f"{what} {name!r} is empty or not a string")
    if "\\" in name or "\x00" in name:
        raise StorageError(f"{what} {name!r} contains a backslash or NUL; names are '/'-separated")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise StorageError(f"{what} {name!r} is absolute; names must be relative to their root")
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../") or "/../" in f"/{norm}/":
        raise StorageError(f"{what} {name!r} escapes its root directory")
    return norm


class Store:
    """A root (local directory or remote prefix) with atomic writes and relative names."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/") or "/"
        if url.startswith("file://"):
            url = url[len("file://") :]
        self.is_local = not is_remote_url(url)
        if self.is_local:
            self.fs = fsspec.filesystem("file")
            self.root = os.path.abspath(os.path.expanduser(url))
        else:
            try:
                self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            except (ImportError, ValueError) as exc:
                raise StorageError(f"cannot open {url!r}: {exc}") from exc
            self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def path(self, name: str) -> str:
        """The full filesystem path (local) or key (remote) of a relative name."""
        name = safe_relpath(name)
        return (
            posixpath.join(self.root, name) if not self.is_local else os.path.join(self.root, name)
        )

    def display(self, name: str) -> str:
        """A name for error messages: the URL the user gave plus the relative name."""
        return f"{self.url}/{name}"

    def local_path(self, name: str) -> str | None:
        """The local path of ``name`` when the root is local, else None."""
        return self.path(name) if self.is_local else None

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self.path(name)))
        except FileNotFoundError as exc:
            raise StorageError(f"{self.display(name)} does not exist") from exc

    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            if start is None and end is None:
                return self.fs.cat_file(self.path(name))
            return self.fs.cat_file(self.path(name), start=start, end=end)
        except FileNotFoundError as exc:
            raise StorageError(f"{self.display(name)} does not exist") from exc

    def open_read(self, name: str) -> IO[bytes]:
        try:
            return self.fs.open(self.path(name), "rb")
        except FileNotFoundError as exc:
            raise StorageError(f"{self.display(name)} does not exist") from exc

    def listdir(self, name: str = "") -> list[str]:
        """Relative names of the entries directly under ``name`` (empty if it is missing)."""
        base = self.path(name) if name else self.root
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        prefix = base.rstrip("/") + "/"
        out = []
        for entry in entries:
            entry = str(entry)
            rel = entry[len(prefix) :] if entry.startswith(prefix) else posixpath.basename(entry)
            out.append(posixpath.join(name, rel) if name else rel)
        return sorted(out)

    def makedirs(self, name: str = "") -> None:
        if self.is_local:
            os.makedirs(self.path(name) if name else self.root, exist_ok=True)

    def remove(self, name: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name), recursive=recursive)

    @contextlib.contextmanager
    def open_write_atomic(self, name: str) -> Iterator[IO[bytes]]:
        """Write ``name`` so readers see the old state or the whole new file, never a part."""
        final = self.path(name)
        if self.is_local:
            directory = os.path.dirname(final)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                with open(tmp, "wb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return
        # Object stores: the object appears only when the upload completes; discard on error.
        f = self.fs.open(final, "wb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard() if hasattr(f, "discard") else None
            raise
        f.close()

    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        with self.open_write_atomic(name) as f:
            f.write(data)
