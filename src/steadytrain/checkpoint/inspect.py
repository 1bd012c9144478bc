"""Listing checkpoints for humans and scripts (the ``checkpoints`` command)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from steadytrain.checkpoint.commit import COMMIT_NAME, verify_local
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.errors import CheckpointError, ReadDeadlineError, StorageError

__all__ = ["list_checkpoints"]


def list_checkpoints(directory: str, checksums: bool = True) -> list[dict[str, Any]]:
    """One row per checkpoint directory, newest first: step, state, size, age, verifies.

    ``state`` is ``committed``, ``partial`` (no COMMIT: a save in flight or one that died) or
    ``damaged`` (a COMMIT that fails its checks: malformed, or its checksum does not match;
    restore skips it). A row never ends the listing, whatever its COMMIT holds.
    """
    root = Root(directory)
    if root.is_local and not os.path.isdir(root.root):
        raise CheckpointError(f"{directory}: no such directory; pass the checkpoint directory")
    now = time.time()
    rows = []
    for info in discover(root):
        verifies, error = False, info.error
        if info.committed:
            try:
                _verify(root, info.name, info.manifest, checksums)
                verifies = True
            except ReadDeadlineError:
                raise  # a store that stopped answering ends the listing (an OSError too)
            except (CheckpointError, StorageError, OSError) as exc:
                error = str(exc)  # one bad checkpoint is a row, not the end of the listing
        elif error is None:
            error = "no COMMIT (partial)"
        state = "committed" if info.committed else ("damaged" if info.error else "partial")
        size = info.size if info.committed else root.dir_size(info.name)
        manifest = info.manifest or {}  # schema-checked by discover() when present
        rows.append(
            {
                "name": info.name,
                "path": root.path(info.name),
                "step": info.step,
                "state": state,
                "size_bytes": size,
                "age_s": max(0.0, now - info.mtime) if info.mtime else None,
                "verifies": verifies,
                "error": None if verifies else error,
                "tokens_seen": manifest.get("tokens_seen"),
                "world_size": (manifest.get("world") or {}).get("world_size"),
                "format_version": manifest.get("format_version"),
            }
        )
    return rows


def _verify(root: Root, name: str, manifest: dict, checksums: bool) -> None:
    if root.is_local:
        verify_local(root.path(name), manifest, checksums=checksums)
        return
    with tempfile.TemporaryDirectory() as tmp:  # remote: fetch and check the bytes
        files = [f["path"] for f in manifest["files"] if f["path"] != COMMIT_NAME]
        root.download(name, files, tmp)
        verify_local(tmp, manifest, checksums=checksums)
