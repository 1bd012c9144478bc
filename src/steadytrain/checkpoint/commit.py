"""Two-phase commit for checkpoint directories: the COMMIT manifest and its verification.

Phase 1: every rank writes its DCP shards (plus its ``state-rankNNNNN.json``) into a fresh
directory ``step-NNNNNNNN`` that has never existed before. Each rank then lists the files it
wrote with sizes and xxh3-64 checksums, and rank 0 gathers the lists.
Phase 2: only when every rank succeeded (and any remote upload was verified) rank 0 writes
``COMMIT`` last, atomically (``storage.publish``: temporary name, fsync, rename, fsync of the
directory; a single PUT on object stores). A directory without a valid COMMIT is *partial* and is never loaded.

DCP's ``.metadata`` is a pickle: unpickling runs code. ``verify()`` therefore checks every
file's size and checksum against COMMIT *before* anything is unpickled, and refuses names that
escape the checkpoint directory. A checksum proves integrity, not authorship: whoever can
write the directory can write a matching COMMIT. Only load checkpoints your own jobs wrote.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any

from steadytrain.errors import CheckpointError
from steadytrain.storage.publish import file_digest, publish_bytes

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "COMMIT_NAME",
    "step_dirname",
    "parse_dirname",
    "safe_name",
    "file_entry",
    "make_manifest",
    "write_commit_local",
    "parse_commit",
    "verify_local",
    "CheckpointInfo",
]

FORMAT = "steadytrain-checkpoint"
FORMAT_VERSION = 1
COMMIT_NAME = "COMMIT"
_DIR_RE = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


def step_dirname(step: int, attempt: int = 0) -> str:
    """``step-00000100``; a re-save of a step that already has a directory gets ``.1``, ..."""
    return f"step-{step:08d}" + (f".{attempt}" if attempt else "")


def parse_dirname(name: str) -> tuple[int, int] | None:
    """(step, attempt) for a checkpoint directory name, None for anything else."""
    m = _DIR_RE.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def safe_name(name: Any) -> str:
    """A relative file name inside a checkpoint directory, or CheckpointError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise CheckpointError(f"COMMIT lists file {name!r}: not a plain relative name")
    norm = posixpath.normpath(name)
    if norm != name or norm.startswith("..") or "/../" in f"/{norm}/":
        raise CheckpointError(f"COMMIT lists file {name!r}, which escapes the checkpoint dir")
    return norm


def file_entry(directory: str, name: str, rank: int) -> dict[str, Any]:
    """One COMMIT file entry: size and bare xxh3-64 hex of ``directory/name``."""
    size, digest = file_digest(os.path.join(directory, name))
    return {"path": name, "size": size, "xxh3_64": digest, "rank": rank}


def make_manifest(
    *,
    step: int,
    files: list[dict[str, Any]],
    world_size: int,
    tokens_seen: int,
    async_mode: str,
    states: list[str],
    block_s: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    names = [f["path"] for f in files]
    if len(set(names)) != len(names):
        raise CheckpointError(f"two ranks wrote the same file in step {step}: {sorted(names)}")
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "tokens_seen": int(tokens_seen),
        "wall_time": time.time(),
        "world": {
            "world_size": int(world_size),
            "async_mode": async_mode,
            "bytes_per_rank": [
                sum(int(f["size"]) for f in files if f.get("rank") == r) for r in range(world_size)
            ],
        },
        "states": sorted(states),
        "files": sorted(files, key=lambda f: f["path"]),
        "total_bytes": sum(int(f["size"]) for f in files),
        "block_s": float(block_s),
        **(extra or {}),
    }


def write_commit_local(directory: str, manifest: dict[str, Any]) -> None:
    """Publish COMMIT atomically and durably (``storage.publish.publish_bytes``)."""
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    publish_bytes(os.path.join(directory, COMMIT_NAME), data)


def parse_commit(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a COMMIT document; CheckpointError names what is wrong."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: COMMIT is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: COMMIT is not a {FORMAT} manifest")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: COMMIT format_version {doc.get('format_version')!r} is not supported "
            f"(this steadytrain reads version {FORMAT_VERSION}); upgrade steadytrain"
        )
    files = doc.get("files")
    if not isinstance(files, list) or not files or not isinstance(doc.get("step"), int):
        raise CheckpointError(f"{where}: COMMIT has no step or file list")
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("size"), int):
            raise CheckpointError(f"{where}: COMMIT has a malformed file entry {f!r}")
        if safe_name(f.get("path")) == COMMIT_NAME:
            raise CheckpointError(f"{where}: COMMIT lists itself as a data file")
    if ".metadata" not in {f["path"] for f in files}:
        raise CheckpointError(f"{where}: COMMIT does not list DCP's .metadata")
    return doc


def is_shard(name: str) -> bool:
    """DCP tensor data files: read by DCP with torch's weights-only unpickler."""
    return name.endswith(".distcp")


def verify_local(
    directory: str,
    manifest: dict[str, Any],
    checksums: bool = True,
    part: tuple[int, int] = (0, 1),
    shards: bool = True,
    others: bool = True,
) -> None:
    """Check every listed file's size (and checksum) before anything is unpickled.

    ``part=(i, n)`` checksums only every n-th file starting at i (sizes are always checked):
    n ranks sharing a directory split the hashing and agree on the result. ``shards=False``
    skips the checksums of ``*.distcp`` data files (sizes still checked): ``.metadata`` (the
    pickle) and the JSON files are hashed unless ``others=False``.
    """
    for idx, f in enumerate(manifest["files"]):
        path = os.path.join(directory, safe_name(f["path"]))
        real = os.path.realpath(path)
        if not real.startswith(os.path.realpath(directory) + os.sep):
            raise CheckpointError(f"{path}: resolves outside the checkpoint directory")
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"{path}: listed in COMMIT but missing") from None
        if size != f["size"]:
            raise CheckpointError(f"{path}: {size} bytes, COMMIT says {f['size']} (truncated?)")
        wanted = shards if is_shard(f["path"]) else others
        if checksums and wanted and idx % part[1] == part[0]:
            _, digest = file_digest(path)
            if digest != f.get("xxh3_64"):
                raise CheckpointError(f"{path}: checksum {digest} != COMMIT {f.get('xxh3_64')}")


@dataclass
class CheckpointInfo:
    """One checkpoint directory as discovered (committed or partial)."""

    name: str
    step: int
    attempt: int
    committed: bool
    manifest: dict[str, Any] | None = None
    error: str | None = None
    mtime: float = 0.0
    size: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, self.attempt)
