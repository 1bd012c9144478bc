"""Names inside a storage root, and what kind of URL a root is.

Everything above ``storage`` speaks in *relative names* inside a root ("shards/x.tokens"),
never in ``pathlib.Path`` (which would mangle ``s3://``). Manifests and COMMIT files come
from storage we may not control, so every name read from one passes ``safe_relpath``.
"""

from __future__ import annotations

import posixpath

from steadytrain.errors import StorageError

__all__ = ["is_remote_url", "backend_module", "safe_relpath"]


def is_remote_url(url: str) -> bool:
    """True for URLs that need a network filesystem (``s3://``, ``gs://``...)."""
    return "://" in url and not url.startswith("file://")


def backend_module(url: str) -> str:
    """The optional package an fsspec protocol needs (for the missing-extra message)."""
    return {"s3": "s3fs", "s3a": "s3fs"}.get(url.split("://", 1)[0], url.split("://", 1)[0] + "fs")


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
