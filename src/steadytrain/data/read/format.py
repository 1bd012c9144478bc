"""Token-shard dataset format v1: manifest, shards, document index, checksums.

The specification a third party can implement from lives in ``docs/format.md``; this module
is the reference reader/writer. A dataset root holds::

    manifest.json                      written last: the dataset exists once this exists
    shards/shard-00000.tokens          little-endian token ids (uint16 or uint32), no header
    shards/shard-00000.idx             little-endian uint64 document end offsets (tokens)
    tokenizer.json                     optional: the tokenizer the ids came from

Checksums are xxh3-64 of the whole file, as 16 lowercase hex digits prefixed ``xxh3_64:``.
The fingerprint identifies the *content* (dtype, vocabulary, EOS and every shard's token
count and checksum, in order), so two tokenize runs over the same input with the same
settings produce the same fingerprint whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from steadytrain.errors import DatasetError, StorageError
from steadytrain.storage.publish import (
    CHECKSUM_ALGO,
    StreamingChecksum,
    canonical_digest,
    checksum_bytes,
)
from steadytrain.storage.store import Store, safe_relpath

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ShardInfo",
    "Manifest",
    "dtype_for_vocab",
    "checksum_bytes",
    "StreamingChecksum",
    "CHECKSUM_ALGO",
    "compute_fingerprint",
    "read_manifest",
    "write_manifest",
]

FORMAT_NAME = "steadytrain.tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SUPPORTED_DTYPES = ("uint16", "uint32")


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    if vocab_size <= 0:
        raise DatasetError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard: its token file and its document index, with sizes and checksums."""

    name: str
    bytes: int
    tokens: int
    docs: int
    checksum: str
    index_name: str
    index_bytes: int
    index_checksum: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "docs": self.docs,
            "checksum": self.checksum,
            "index": {
                "name": self.index_name,
                "bytes": self.index_bytes,
                "checksum": self.index_checksum,
            },
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> ShardInfo:
        try:
            index = obj["index"]
            info = cls(
                name=safe_relpath(obj["name"], what=f"{where}: shard name"),
                bytes=int(obj["bytes"]),
                tokens=int(obj["tokens"]),
                docs=int(obj["docs"]),
                checksum=str(obj["checksum"]),
                index_name=safe_relpath(index["name"], what=f"{where}: index name"),
                index_bytes=int(index["bytes"]),
                index_checksum=str(index["checksum"]),
            )
        except StorageError as exc:
            raise DatasetError(str(exc)) from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{where}: malformed shard entry {obj!r} ({exc!r})") from exc
        if min(info.bytes, info.tokens, info.docs, info.index_bytes) < 0:
            raise DatasetError(f"{where}: negative size in shard entry {info.name}")
        return info


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a dataset."""

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer: dict[str, Any]
    shards: tuple[ShardInfo, ...]
    fingerprint: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def num_docs(self) -> int:
        return sum(s.docs for s in self.shards)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def summary(self) -> dict[str, Any]:
        """The headline numbers every command reports (``inspect``'s JSON keys)."""
        return {
            "num_tokens": self.num_tokens,
            "num_docs": self.num_docs,
            "num_shards": len(self.shards),
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "fingerprint": self.fingerprint,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype,
            "byte_order": "little",
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": self.tokenizer,
            "num_tokens": self.num_tokens,
            "num_docs": self.num_docs,
            "num_shards": len(self.shards),
            "fingerprint": self.fingerprint,
            "shards": [s.to_json() for s in self.shards],
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, obj: Any, *, where: str) -> Manifest:
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: not a JSON object; is this a steadytrain dataset?")
        fmt, version = obj.get("format"), obj.get("version")
        if fmt != FORMAT_NAME:
            raise DatasetError(
                f"{where}: format {fmt!r} is not {FORMAT_NAME!r}; is this a steadytrain dataset?"
            )
        if version != FORMAT_VERSION:
            raise DatasetError(
                f"{where}: format version {version!r} is not supported (this steadytrain reads "
                f"version {FORMAT_VERSION}); upgrade steadytrain or re-tokenize the data"
            )
        dtype = obj.get("dtype")
        if dtype not in SUPPORTED_DTYPES:
            raise DatasetError(f"{where}: dtype {dtype!r} is not one of {SUPPORTED_DTYPES}")
        if obj.get("byte_order", "little") != "little":
            raise DatasetError(f"{where}: byte_order must be 'little'")
        try:
            vocab_size, eos_id = int(obj["vocab_size"]), int(obj["eos_id"])
            raw_shards = obj["shards"]
            fingerprint = str(obj["fingerprint"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{where}: missing or malformed field ({exc!r})") from exc
        if not isinstance(raw_shards, list):
            raise DatasetError(f"{where}: 'shards' must be a list")
        if not 0 <= eos_id < vocab_size:
            raise DatasetError(f"{where}: eos_id {eos_id} outside the vocabulary [0, {vocab_size})")
        if np.iinfo(np.dtype(dtype)).max < vocab_size - 1:
            raise DatasetError(f"{where}: dtype {dtype} cannot hold vocab_size {vocab_size}")
        shards = tuple(ShardInfo.from_json(s, where=where) for s in raw_shards)
        names = [s.name for s in shards] + [s.index_name for s in shards]
        if len(set(names)) != len(names):
            raise DatasetError(f"{where}: two shard entries share a file name")
        return cls(
            dtype=dtype,
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer=dict(obj.get("tokenizer") or {}),
            shards=shards,
            fingerprint=fingerprint,
            extra=dict(obj.get("extra") or {}),
        )


def compute_fingerprint(dtype: str, vocab_size: int, eos_id: int, shards: list[ShardInfo]) -> str:
    """Content identity: settings plus every shard's token count and checksum, in order."""
    return canonical_digest(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": dtype,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "shards": [[s.tokens, s.docs, s.checksum] for s in shards],
        }
    )


def read_manifest(store: Store) -> Manifest:
    """Read and validate ``manifest.json``; errors name the file and the fix."""
    where = store.display(MANIFEST_NAME)
    if not store.exists(MANIFEST_NAME):
        raise DatasetError(
            f"{where} does not exist: {store.url} is not a dataset, or it was never completed "
            f"(the manifest is written last); run `steadytrain tokenize ... --out {store.url}`"
        )
    raw = store.read_bytes(MANIFEST_NAME)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc}); the manifest is damaged") from exc
    manifest = Manifest.from_json(obj, where=where)
    expected = compute_fingerprint(
        manifest.dtype, manifest.vocab_size, manifest.eos_id, list(manifest.shards)
    )
    if manifest.fingerprint != expected:
        raise DatasetError(
            f"{where}: fingerprint {manifest.fingerprint} does not match its shard list "
            f"({expected}); the manifest was edited or damaged"
        )
    return manifest


def write_manifest(store: Store, manifest: Manifest) -> None:
    """Publish the manifest atomically. Call this last, after every shard is published."""
    data = json.dumps(manifest.to_json(), indent=1, sort_keys=False).encode()
    store.write_bytes_atomic(MANIFEST_NAME, data + b"\n")
