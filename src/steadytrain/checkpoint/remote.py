"""Checkpoint roots addressed by a local path or an fsspec URL; upload, download, discovery.

A remote checkpoint is first written to the local directory, then each rank uploads the files
it wrote, sizes are checked on the remote side, and only then rank 0 PUTs ``COMMIT`` (a
single object written last, so an object-store reader never sees COMMIT before the data).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
from typing import Any

import fsspec

from steadytrain.checkpoint.commit import (
    COMMIT_NAME,
    CheckpointInfo,
    parse_commit,
    parse_dirname,
    safe_name,
)
from steadytrain.errors import CheckpointError

__all__ = ["Root", "discover"]


class Root:
    """A directory of checkpoints: local path, ``file://`` URL or object-store URL."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        if "://" in url and not url.startswith("file://"):
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            self.is_local = False
        else:
            path = url[len("file://") :] if url.startswith("file://") else url
            self.fs = fsspec.filesystem("file")
            self.root = os.path.abspath(os.path.expanduser(path))
            self.is_local = True
        self.root = self.root.rstrip("/")

    def path(self, *names: str) -> str:
        return posixpath.join(self.root, *(safe_name(n) for n in names))

    def _fresh(self) -> None:
        if not self.is_local:
            self.fs.invalidate_cache()  # another process may have written since

    def listdir(self) -> list[str]:
        self._fresh()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def read_bytes(self, *names: str) -> bytes:
        return self.fs.cat_file(self.path(*names))

    def mtime(self, name: str) -> float:
        try:
            info = self.fs.info(self.path(name, COMMIT_NAME))
        except (FileNotFoundError, OSError):
            try:
                info = self.fs.info(self.path(name))
            except (FileNotFoundError, OSError):
                return 0.0
        m = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
        return m.timestamp() if hasattr(m, "timestamp") else float(m)

    def upload(self, local_dir: str, name: str, files: list[str]) -> None:
        """Upload ``files`` of ``local_dir`` into ``name/`` and check their sizes there."""
        for f in files:
            dst = self.path(name, f)
            self.fs.makedirs(posixpath.dirname(dst), exist_ok=True)
            self.fs.put_file(os.path.join(local_dir, f), dst)
        self._fresh()
        for f in files:
            want = os.path.getsize(os.path.join(local_dir, f))
            got = self.fs.size(self.path(name, f))
            if got != want:
                raise CheckpointError(f"upload of {self.url}/{name}/{f}: {got} bytes != {want}")

    def put_commit(self, name: str, data: bytes) -> None:
        """Write COMMIT last: a single PUT on object stores, tmp + rename locally."""
        dst = self.path(name, COMMIT_NAME)
        if self.is_local:
            tmp = dst + f".tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        else:
            self.fs.pipe_file(dst, data)

    def download(self, name: str, files: list[str], local_dir: str) -> None:
        os.makedirs(local_dir, exist_ok=True)
        for f in files:
            self.fs.get_file(self.path(name, f), os.path.join(local_dir, safe_name(f)))

    def remove(self, name: str) -> None:
        """Delete a checkpoint directory, COMMIT first so a crash leaves it partial, not torn."""
        try:
            self.fs.rm(self.path(name, COMMIT_NAME))
        except (FileNotFoundError, OSError):
            pass
        if self.is_local:
            shutil.rmtree(self.path(name), ignore_errors=True)
        else:
            # Two passes: filer-backed stores (SeaweedFS) keep the emptied "directory" as an
            # object until a second delete; a cached listing would hide what is left.
            for _ in range(2):
                self._fresh()
                try:
                    self.fs.rm(self.path(name), recursive=True)
                except FileNotFoundError:
                    break

    def dir_size(self, name: str) -> int:
        try:
            return int(sum(self.fs.du(self.path(name), total=False).values()))
        except (FileNotFoundError, OSError):
            return 0


def discover(root: Root) -> list[CheckpointInfo]:
    """Checkpoint directories under ``root``, newest (step, attempt) first."""
    out = []
    for name in root.listdir():
        parsed = parse_dirname(name)
        if parsed is None:
            continue
        info = CheckpointInfo(name=name, step=parsed[0], attempt=parsed[1], committed=False)
        try:
            raw = root.read_bytes(name, COMMIT_NAME)
        except (FileNotFoundError, OSError, IsADirectoryError):
            raw = None
        if raw is not None:
            try:
                info.manifest = parse_commit(raw, f"{root.url}/{name}")
                if info.manifest["step"] != info.step:
                    raise CheckpointError(
                        f"{root.url}/{name}: COMMIT says step {info.manifest['step']}"
                    )
                info.committed = True
                info.size = int(info.manifest.get("total_bytes", 0))
                info.mtime = float(info.manifest.get("wall_time", 0.0))
            except CheckpointError as exc:
                info.error = str(exc)
        if not info.committed:
            info.mtime = root.mtime(name) or time.time()
        out.append(info)
    out.sort(key=lambda i: i.key, reverse=True)
    return out
