"""Checkpoint roots addressed by a local path or a URL; upload, download, discovery.

A remote checkpoint is first written to the local directory, then each rank uploads the files
it wrote, sizes are checked on the remote side, and only then rank 0 PUTs ``COMMIT`` (a
single object written last, so an object-store reader never sees COMMIT before the data).

``Root`` only knows the checkpoint layout (``step-…/`` directories holding files and a
COMMIT); every byte goes through ``steadytrain.storage.store.Store``, so checkpoint copies get
the same endpoint resolution (``STEADYTRAIN_S3_ENDPOINT``…), per-request deadlines, retries
and error messages (a ``StorageError`` naming the URL and the fix) as datasets do.
"""

from __future__ import annotations

import os
import posixpath
import stat
import time
from typing import Any

from steadytrain.checkpoint.commit import (
    COMMIT_NAME,
    MAX_COMMIT_BYTES,
    CheckpointInfo,
    parse_commit,
    parse_dirname,
    safe_name,
)
from steadytrain.checkpoint.regular import NotRegularFileError, inside, read_regular
from steadytrain.errors import CheckpointError, StorageError
from steadytrain.storage.store import Store, is_missing

__all__ = ["Root", "discover", "newest_manifest"]


class Root:
    """A directory of checkpoints: local path, ``file://`` URL or object-store URL.

    ``root`` is the local directory (absolute) or the object-store key prefix; ``store`` is
    the ``Store`` every request goes through.
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, store: Store | None = None
    ) -> None:
        self.url = url
        self.store = store or Store(url, storage_options)
        self.is_local = self.store.is_local
        self.root = self.store.root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Root({self.url!r})"

    def _name(self, *names: str) -> str:
        """The store-relative name of a file in a checkpoint (each part checked)."""
        return posixpath.join(*(safe_name(n) for n in names))

    def path(self, *names: str) -> str:
        """The local path or object key of ``names`` (for messages and local readers)."""
        return posixpath.join(self.root, self._name(*names)) if names else self.root

    def listdir(self) -> list[str]:
        """Names of the entries directly under the root (empty when it does not exist)."""
        return sorted(posixpath.basename(e.rstrip("/")) for e in self.store.listdir())

    def read_bytes(self, *names: str) -> bytes:
        return self.store.read_bytes(self._name(*names))

    def read_commit(self, name: str) -> bytes | None:
        """The COMMIT of checkpoint ``name``, or None when it has none (a partial save).

        Only "not there" means partial: any other error (a dead endpoint, a bad key) is
        raised, because reading it as partial would let retention delete a committed save.
        """
        if self.is_local:
            return self._read_local_commit(name)
        try:
            return self.read_bytes(name, COMMIT_NAME)
        except (IsADirectoryError, NotADirectoryError):
            return None  # not a COMMIT file, or ``name`` is not a directory: not committed
        except StorageError as exc:
            if is_missing(exc):
                return None
            raise
        except OSError as exc:  # a local file we may not read
            raise CheckpointError(
                f"cannot read {self.path(name, COMMIT_NAME)}: {exc}; fix its permissions"
            ) from exc

    def _read_local_commit(self, name: str) -> bytes | None:
        """A local COMMIT, read only when it is a regular file inside the root: a FIFO there
        blocked every listing and resume forever (CheckpointError naming it instead)."""
        path = self.path(name, COMMIT_NAME)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}; fix its permissions") from exc
        if stat.S_ISDIR(st.st_mode):
            return None  # not a COMMIT file: not committed
        if not inside(path, self.root):
            raise NotRegularFileError(f"{path}: a link that leaves the checkpoint root {self.root}")
        try:
            return read_regular(path, limit=MAX_COMMIT_BYTES + 1)  # parse_commit refuses more
        except NotRegularFileError:
            raise
        except CheckpointError:
            if not os.path.lexists(path):
                return None  # removed since the lstat (retention): not committed
            raise

    def escapes(self, name: str) -> str | None:
        """Why local entry ``name`` is not read (a link leaving the root), else None."""
        path = self.path(name)
        if self.is_local and os.path.islink(path) and not inside(path, self.root):
            return (
                f"{path} is a link to {os.path.realpath(path)}, outside the checkpoint root: "
                "not read, and never deleted by retention; remove the link if it is not meant "
                "to be there"
            )
        return None

    def mtime(self, name: str) -> float:
        """When checkpoint ``name`` was committed (else last touched); 0.0 when unknown (an
        object-store "directory" has no time of its own)."""
        for rel in (self._name(name, COMMIT_NAME), self._name(name)):
            try:
                info = self.store.info(rel)
            except StorageError as exc:
                if is_missing(exc):
                    continue
                raise
            except OSError:  # a local entry that is not a directory: nothing better to say
                continue
            m = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
            if m:
                return m.timestamp() if hasattr(m, "timestamp") else float(m)
        return 0.0

    def upload(self, local_dir: str, name: str, files: list[str]) -> None:
        """Upload ``files`` of ``local_dir`` into ``name/`` and check their sizes there."""
        for f in files:
            self.store.put_file(os.path.join(local_dir, f), self._name(name, f))
        for f in files:
            want = os.path.getsize(os.path.join(local_dir, f))
            got = self.store.size(self._name(name, f))
            if got != want:
                raise CheckpointError(
                    f"upload of {self.url}/{name}/{f}: {got} bytes on the remote, {want} "
                    "locally; the save is discarded, check the store's free space and retry"
                )

    def put_commit(self, name: str, data: bytes) -> None:
        """Write COMMIT last: a single PUT on object stores; locally through
        ``storage.publish`` (temporary name, fsync, rename, fsync of the directory)."""
        self.store.write_bytes_atomic(self._name(name, COMMIT_NAME), data)

    def download(self, name: str, files: list[str], local_dir: str) -> None:
        """Copy ``files`` of checkpoint ``name`` into ``local_dir``; each file is published
        whole. Not fsync'ed: the copy is verified against COMMIT and used at once."""
        os.makedirs(local_dir, exist_ok=True)
        for f in files:
            dst = os.path.join(local_dir, safe_name(f))
            self.store.get_file(self._name(name, f), dst, durable=False)

    def remove(self, name: str) -> None:
        """Delete a checkpoint directory, COMMIT first so a crash leaves it partial, not torn."""
        self.store.remove(self._name(name, COMMIT_NAME))
        self.store.remove_tree(self._name(name))

    def dir_size(self, name: str) -> int:
        """Bytes under checkpoint ``name`` (0 when it is gone)."""
        return self.store.du(self._name(name))


def discover(root: Root) -> list[CheckpointInfo]:
    """Checkpoint directories under ``root``, newest (step, attempt) first."""
    out = []
    for name in root.listdir():
        parsed = parse_dirname(name)
        if parsed is None:
            continue
        info = CheckpointInfo(name=name, step=parsed[0], attempt=parsed[1], committed=False)
        info.error = root.escapes(name)
        if info.error is not None:
            info.extra["foreign"] = True  # retention leaves it alone (it is not ours)
            out.append(info)
            continue
        try:
            raw = root.read_commit(name)
        except NotRegularFileError as exc:  # a FIFO, a device, a link out: damaged (other
            raw, info.error = None, str(exc)  # read errors propagate, as a COMMIT's always did)
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


def newest_manifest(root: Root) -> dict[str, Any] | None:
    """The COMMIT of the newest committed checkpoint under ``root``, or None. Cheaper than
    ``discover`` when only the newest matters: one listing and one COMMIT read (more only
    past newer directories with no valid COMMIT, each skipped as ``discover`` would)."""
    names = sorted(((p, n) for n in root.listdir() if (p := parse_dirname(n))), reverse=True)
    for (step, _), name in names:
        try:
            raw = None if root.escapes(name) else root.read_commit(name)
            manifest = parse_commit(raw, f"{root.url}/{name}") if raw is not None else None
        except CheckpointError:  # damaged or not a regular file: not what a restore loads
            continue
        if manifest is not None and manifest["step"] == step:
            return manifest
    return None
