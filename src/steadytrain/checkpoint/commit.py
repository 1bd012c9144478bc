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

COMMIT itself is checked before anything else is read (``parse_commit``): its size, its JSON
(nesting depth, no NaN, no repeated keys), every documented field's type and range
(docs/format.md, part D), and ``commit_checksum``, an xxh3-128 of the canonical JSON of all its
other fields, so one flipped bit anywhere in it (``tokens_seen`` included) is refused rather
than loaded. Version 1 COMMITs (written before the checksum existed) still load, fully
validated, with a warning that their own fields are unprotected.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any

from steadytrain.checkpoint.regular import inside, open_regular, stat_regular
from steadytrain.errors import CheckpointError
from steadytrain.run_identity import is_nonce
from steadytrain.storage.publish import Hasher, canonical_digest, file_digest, publish_bytes

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "COMMIT_NAME",
    "MAX_STEP",
    "step_dirname",
    "parse_dirname",
    "safe_name",
    "file_entry",
    "make_manifest",
    "seal",
    "commit_bytes",
    "write_commit_local",
    "parse_commit",
    "verify_local",
    "CheckpointInfo",
]

FORMAT = "steadytrain-checkpoint"
# 3: shard files may hold raw tensor records (world.tensor_format "raw", raw_records.py),
# which a reader that knows only DCP's archives would fail on; 2: adds commit_checksum (and
# is still what a "torch_save" checkpoint says); 1 still loads (validated, with a warning).
FORMAT_VERSION = 3
TORCH_SAVE_VERSION = 2
READ_VERSIONS = (1, 2, 3)
COMMIT_NAME = "COMMIT"
CHECKSUM_KEY = "commit_checksum"
_CHECKSUM_PREFIX = "xxh3_128:"
# A real COMMIT is ~100 bytes per file (a 16k-rank job: a few MB) and 3 levels deep; far
# beyond either it is damage or an attack, refused before json.loads spends memory on it.
MAX_COMMIT_BYTES = 64 << 20
MAX_DEPTH = 16
_HEX64 = re.compile(r"^[0-9a-f]{16}$")
log = logging.getLogger("steadytrain.checkpoint")
_warned_v1: set[str] = set()
# Steps are below 2**53, as the ledger's readers take them (monitor/records.MAX_INT): there
# a float no longer counts by one. steadytrain.Run refuses a larger step_done; a COMMIT
# that claims one (written by an older steadytrain, or by hand) is damaged, so the next
# start skips it instead of filling 10**30 recovered steps.
MAX_STEP = 2**53
# ASCII digits, at most 64: a longer name is not a checkpoint (Python's int() refuses 4301
# digits with ValueError, which would stop discovery); a step-10**30 directory is still
# seen, and its COMMIT refused as damaged by name (commit_schema).
_DIR_RE = re.compile(r"^step-([0-9]{8,64})(?:\.([0-9]{1,9}))?$")
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
    tensor_format: str = "raw",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    names = [f["path"] for f in files]
    if len(set(names)) != len(names):
        raise CheckpointError(f"two ranks wrote the same file in step {step}: {sorted(names)}")
    return seal(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION if tensor_format == "raw" else TORCH_SAVE_VERSION,
            "step": int(step),
            "tokens_seen": int(tokens_seen),
            "wall_time": time.time(),
            "world": {
                "world_size": int(world_size),
                "async_mode": async_mode,
                "tensor_format": tensor_format,
                "bytes_per_rank": [
                    sum(int(f["size"]) for f in files if f.get("rank") == r)
                    for r in range(world_size)
                ],
            },
            "states": sorted(states),
            "files": sorted(files, key=lambda f: f["path"]),
            "total_bytes": sum(int(f["size"]) for f in files),
            "block_s": float(block_s),
            **(extra or {}),
        }
    )


def _checksum(manifest: dict[str, Any]) -> str:
    """``xxh3_128:<hex>`` of the canonical JSON of every field but the checksum itself."""
    return _CHECKSUM_PREFIX + canonical_digest(
        {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    )


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` with ``commit_checksum`` over all its other fields (fields
    added after ``make_manifest`` are covered when the copy is sealed again)."""
    out = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    out[CHECKSUM_KEY] = _checksum(out)
    return out


def commit_bytes(manifest: dict[str, Any]) -> bytes:
    """The bytes of COMMIT for ``manifest``, sealed: the one serialisation, local or remote."""
    return json.dumps(seal(manifest), indent=1, sort_keys=True).encode()


def write_commit_local(directory: str, manifest: dict[str, Any]) -> None:
    """Publish COMMIT atomically and durably (``storage.publish.publish_bytes``)."""
    publish_bytes(os.path.join(directory, COMMIT_NAME), commit_bytes(manifest))


def parse_commit(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and validate a COMMIT document; CheckpointError names what is wrong.

    Nothing in a COMMIT is used before all of it passed: size, JSON, the schema of
    docs/format.md part D (``commit_schema``) and, from version 2 on, ``commit_checksum``.
    """
    fix = "the COMMIT is damaged: restore skips this checkpoint for the next older one"
    if len(raw) > MAX_COMMIT_BYTES:
        raise CheckpointError(
            f"{where}: COMMIT is {len(raw)} bytes, more than the {MAX_COMMIT_BYTES} any real "
            f"one needs; {fix}"
        )
    try:
        doc = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_repeats, parse_constant=_no_constant
        )
    except RecursionError:
        raise CheckpointError(f"{where}: COMMIT nests too deeply to be a manifest; {fix}") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{where}: COMMIT is not valid JSON ({exc}); {fix}") from None
    if _depth(doc) > MAX_DEPTH:
        raise CheckpointError(f"{where}: COMMIT nests deeper than {MAX_DEPTH} levels; {fix}")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: COMMIT is not a {FORMAT} manifest; {fix}")
    version = doc.get("format_version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise CheckpointError(
            f"{where}: COMMIT format_version {version!r} is not supported (this steadytrain "
            f"reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade steadytrain"
        )
    if CHECKSUM_KEY in doc:  # checked whatever the version says: the version is covered too
        if doc[CHECKSUM_KEY] != _checksum(doc):
            raise CheckpointError(
                f"{where}: COMMIT's {CHECKSUM_KEY} {doc[CHECKSUM_KEY]!r} does not match its "
                f"fields ({_checksum(doc)}): a byte of it changed after it was written; {fix}"
            )
    elif version >= 2:
        raise CheckpointError(f"{where}: COMMIT has no {CHECKSUM_KEY}; {fix}")
    elif where not in _warned_v1:
        _warned_v1.add(where)
        log.warning(
            "%s: COMMIT format_version 1 has no %s: its files are checksummed but its own "
            "fields (step, tokens_seen, ...) are not; it loads after schema checks. The next "
            "save writes version 2",
            where,
            CHECKSUM_KEY,
        )
    problem = commit_schema(doc)
    if problem:
        raise CheckpointError(f"{where}: COMMIT {problem}; {fix}")
    return doc


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (json.loads would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            todo.extend((v, depth + 1) for v in value)
    return deepest


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def commit_schema(doc: dict[str, Any]) -> str | None:
    """What in a parsed COMMIT breaks docs/format.md part D, or None when it all fits.

    Keys beyond these are allowed (newer writers may add some; the checksum covers them).
    """
    for key in ("step", "tokens_seen", "total_bytes"):
        if not _is_int(doc.get(key)):
            return f"{key}={doc.get(key)!r} is not a non-negative integer"
    if doc["step"] >= MAX_STEP:
        return f"step={doc['step']} is not below 2**53 (no training has that many steps)"
    for key in ("wall_time", "block_s"):
        if not _is_number(doc.get(key)):
            return f"{key}={doc.get(key)!r} is not a non-negative number"
    world = doc.get("world")
    if not isinstance(world, dict):
        return f"world={world!r} is not an object"
    size = world.get("world_size")
    if not _is_int(size, 1):
        return f"world.world_size={size!r} is not a positive integer"
    if not isinstance(world.get("async_mode"), str):
        return f"world.async_mode={world.get('async_mode')!r} is not a string"
    if doc.get("format_version") == FORMAT_VERSION and world.get("tensor_format") not in (
        "raw",
        "torch_save",
    ):
        return f"world.tensor_format={world.get('tensor_format')!r} is neither raw nor torch_save"
    per_rank = world.get("bytes_per_rank")
    if not (isinstance(per_rank, list) and len(per_rank) == size):
        return f"world.bytes_per_rank is not a list of {size} integers"
    states = doc.get("states")
    if not (isinstance(states, list) and all(isinstance(n, str) for n in states)):
        return f"states={states!r} is not a list of names"
    if not isinstance(doc.get("remote"), (str, type(None))):
        return f"remote={doc.get('remote')!r} is neither a URL nor null"
    if "run_nonce" in doc and not is_nonce(doc["run_nonce"]):
        return f"run_nonce={str(doc['run_nonce'])[:80]!r} is not a run nonce (32 hex digits)"
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        return "has no file list"
    sums = [0] * size
    names = set()
    for f in files:
        if not (
            isinstance(f, dict)
            and _is_int(f.get("size"))
            and isinstance(f.get("xxh3_64"), str)
            and _HEX64.match(f["xxh3_64"])
            and _is_int(f.get("rank"))
            and f["rank"] < size
        ):
            return f"has a malformed file entry {str(f)[:200]}"
        try:
            name = safe_name(f.get("path"))
        except CheckpointError as exc:
            return str(exc).removeprefix("COMMIT ")
        if name == COMMIT_NAME:
            return "lists itself as a data file"
        if name in names:
            return f"lists {name} twice"
        names.add(name)
        sums[f["rank"]] += f["size"]
    if ".metadata" not in names:
        return "does not list DCP's .metadata"
    if doc["total_bytes"] != sum(sums):
        return f"total_bytes={doc['total_bytes']} is not the sum of its files' sizes {sum(sums)}"
    if per_rank != sums:
        return f"world.bytes_per_rank={str(per_rank)[:200]} disagrees with its files {sums}"
    return None


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
        if not inside(path, directory):
            raise CheckpointError(f"{path}: resolves outside the checkpoint directory")
        # A FIFO or a device in place of a listed file is refused here, before any open()
        # (one blocked ``checkpoints`` and every resume forever).
        size = stat_regular(path).st_size
        if size != f["size"]:
            how = "shorter (truncated?)" if size < f["size"] else "longer (appended to?)"
            raise CheckpointError(f"{path}: {size} bytes, COMMIT says {f['size']}: {how}")
        wanted = shards if is_shard(f["path"]) else others
        if checksums and wanted and idx % part[1] == part[0]:
            digest = _digest_regular(path)
            if digest != f.get("xxh3_64"):
                raise CheckpointError(f"{path}: checksum {digest} != COMMIT {f.get('xxh3_64')}")


def _digest_regular(path: str, chunk: int = 8 << 20) -> str:
    """Bare xxh3-64 hex of a file opened by ``open_regular`` (never a FIFO or a device)."""
    h = Hasher()
    with open(open_regular(path), "rb", closefd=True) as f:
        while piece := f.read(chunk):
            h.update(piece)
    return h.digest_hex()


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
