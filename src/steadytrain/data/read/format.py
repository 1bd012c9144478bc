"""Token-shard dataset format v1: manifest, shards, document index, checksums.

The specification a third party can implement from lives in ``docs/format.md``; this module
is the reference reader/writer. A dataset root holds::

    manifest.json                      written last: the dataset exists once this exists
    shards/shard-00000.tokens          little-endian token ids (uint16 or uint32), no header
    shards/shard-00000.idx             little-endian uint64 document end offsets (tokens)
    tokenizer.json                     optional: the tokenizer the ids came from

Checksums are xxh3-64 of the whole file, as 16 lowercase hex digits prefixed ``xxh3_64:``.
The fingerprint identifies the *content* (dtype, vocabulary, EOS and every shard's token
count, document count, token-file checksum and document-index checksum, in order), so two
tokenize runs over the same input with the same settings produce the same fingerprint
whatever the number of workers, and moving one document boundary changes it.

Fingerprint schemes (``fingerprint_version`` in the manifest): 2, written since the
document index is covered; 1 (the key absent), written before, which covers the token
files only. Both are read; a scheme-1 dataset keeps its fingerprint (loader states and cache
entries keyed on it stay valid).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from steadytrain.data.read.untrusted import check_small_file
from steadytrain.data.read.untrusted import short_repr as _short
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
    "FINGERPRINT_VERSION",
    "read_manifest",
    "parse_manifest",
    "write_manifest",
]

FORMAT_NAME = "steadytrain.tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SUPPORTED_DTYPES = ("uint16", "uint32")
FINGERPRINT_VERSION = 2  # what writers use; 1 (legacy) did not cover the document index
FINGERPRINT_VERSIONS = (1, 2)
# Upper bound of any size or count in a manifest: 1 PiB per file, and totals below 2**62,
# so no sum or product a reader forms overflows int64 (numpy) or asks mmap for the absurd.
MAX_FILE_BYTES = 1 << 50
MAX_TOTAL = 1 << 62
MAX_MANIFEST_BYTES = 1 << 30  # ~250 bytes a shard: millions of shards fit


def _int_field(
    obj: dict[str, Any], key: str, where: str, low: int = 0, high: int = MAX_TOTAL
) -> int:
    """An integer field (a JSON integer, not a bool, float or string) within [low, high]."""
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DatasetError(
            f"{where}: {key} must be an integer, got {_short(value)}; the manifest is damaged: "
            f"run `steadytrain verify` on the dataset, or re-tokenize it"
        )
    if not low <= value <= high:
        raise DatasetError(
            f"{where}: {key}={_short(value)} is outside [{low}, {high}]; the manifest is damaged: "
            f"run `steadytrain verify` on the dataset, or re-tokenize it"
        )
    return value


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
    def from_json(cls, obj: Any, *, where: str) -> ShardInfo:
        if not isinstance(obj, dict) or not isinstance(obj.get("index"), dict):
            raise DatasetError(
                f"{where}: malformed shard entry {_short(obj)} (an object with name, bytes, "
                f"tokens, docs, checksum and an index object is needed); the manifest is "
                f"damaged: re-tokenize the dataset"
            )
        index = obj["index"]
        try:
            name = safe_relpath(obj.get("name"), what=f"{where}: shard name")
            index_name = safe_relpath(index.get("name"), what=f"{where}: index name")
        except StorageError as exc:
            raise DatasetError(str(exc)) from exc
        at = f"{where}: shard {name}"
        for key, holder in (("checksum", obj), ("checksum", index)):
            if not isinstance(holder.get(key), str):
                raise DatasetError(
                    f"{at}: {key} must be a string, got {_short(holder.get(key))}; the "
                    f"manifest is damaged: re-tokenize the dataset"
                )
        return cls(
            name=name,
            bytes=_int_field(obj, "bytes", at, high=MAX_FILE_BYTES),
            tokens=_int_field(obj, "tokens", at, high=MAX_FILE_BYTES),
            docs=_int_field(obj, "docs", at, high=MAX_FILE_BYTES),
            checksum=obj["checksum"],
            index_name=index_name,
            index_bytes=_int_field(index, "bytes", f"{at} index", high=MAX_FILE_BYTES),
            index_checksum=index["checksum"],
        )

    def check_sizes(self, itemsize: int, *, where: str) -> None:
        """The listed sizes agree with each other (format.md A.2): a manifest claiming 10**18
        tokens in a small file, or sizes of another dtype, fails here by name instead of in
        numpy's mmap."""
        if self.bytes != self.tokens * itemsize:
            raise DatasetError(
                f"{where}: shard {self.name} lists {self.bytes} bytes for {self.tokens} tokens of "
                f"{itemsize} bytes each ({self.tokens * itemsize} expected); the manifest is "
                f"damaged or its dtype is wrong: run `steadytrain verify` on the dataset, or "
                f"re-tokenize it"
            )
        if self.index_bytes != self.docs * 8:
            raise DatasetError(
                f"{where}: index {self.index_name} lists {self.index_bytes} bytes for "
                f"{self.docs} documents ({self.docs * 8} expected); the manifest is damaged: "
                f"run `steadytrain verify` on the dataset, or re-tokenize it"
            )
        if (self.docs == 0) != (self.tokens == 0) or self.docs > self.tokens:
            raise DatasetError(
                f"{where}: shard {self.name} lists {self.docs} documents for {self.tokens} "
                f"tokens (every document holds at least one token); the manifest is damaged: "
                f"re-tokenize the dataset"
            )


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
    # 2: the fingerprint covers the document index; 1: a dataset written before it did
    fingerprint_version: int = FINGERPRINT_VERSION

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
            # absent for a legacy (scheme 1) manifest, so re-serialising one changes nothing
            **(
                {"fingerprint_version": self.fingerprint_version}
                if self.fingerprint_version != 1
                else {}
            ),
            "shards": [s.to_json() for s in self.shards],
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_json(cls, obj: Any, *, where: str) -> Manifest:
        """Validate a parsed manifest (untrusted input: any JSON value). Every problem is a
        ``DatasetError`` naming ``where``; nothing else escapes."""
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: not a JSON object; is this a steadytrain dataset?")
        fmt, version = obj.get("format"), obj.get("version")
        if fmt != FORMAT_NAME:
            raise DatasetError(
                f"{where}: format {_short(fmt)} is not {FORMAT_NAME!r}; is this a steadytrain "
                f"dataset?"
            )
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise DatasetError(
                f"{where}: format version {_short(version)} is not supported (this steadytrain "
                f"reads version {FORMAT_VERSION}); upgrade steadytrain or re-tokenize the data"
            )
        dtype = obj.get("dtype")
        if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
            raise DatasetError(
                f"{where}: dtype {_short(dtype)} is not one of {SUPPORTED_DTYPES}; the manifest "
                f"is damaged: re-tokenize the dataset"
            )
        if obj.get("byte_order", "little") != "little":
            raise DatasetError(f"{where}: byte_order must be 'little'")
        scheme = obj.get("fingerprint_version", 1)
        if isinstance(scheme, bool) or scheme not in FINGERPRINT_VERSIONS:
            raise DatasetError(
                f"{where}: fingerprint_version {_short(scheme)} is not one of "
                f"{FINGERPRINT_VERSIONS}; upgrade steadytrain or re-tokenize the data"
            )
        vocab_size = _int_field(obj, "vocab_size", where, low=1, high=1 << 32)
        eos_id = _int_field(obj, "eos_id", where, high=1 << 32)
        raw_shards, fingerprint = obj.get("shards"), obj.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise DatasetError(
                f"{where}: missing or malformed field fingerprint ({_short(fingerprint)}, a "
                f"string is needed); the manifest is damaged: re-tokenize the dataset"
            )
        if not isinstance(raw_shards, list):
            raise DatasetError(f"{where}: 'shards' must be a list")
        if not 0 <= eos_id < vocab_size:
            raise DatasetError(f"{where}: eos_id {eos_id} outside the vocabulary [0, {vocab_size})")
        if np.iinfo(np.dtype(dtype)).max < vocab_size - 1:
            raise DatasetError(f"{where}: dtype {dtype} cannot hold vocab_size {vocab_size}")
        for key in ("tokenizer", "extra"):
            if obj.get(key) is not None and not isinstance(obj[key], dict):
                raise DatasetError(
                    f"{where}: {key} must be an object, got {_short(obj[key])}; the manifest "
                    f"is damaged: re-tokenize the dataset"
                )
        tokenizer = dict(obj.get("tokenizer") or {})
        if "file" in tokenizer:
            try:
                tokenizer["file"] = safe_relpath(tokenizer["file"], what=f"{where}: tokenizer.file")
            except StorageError as exc:
                raise DatasetError(str(exc)) from exc
        shards = tuple(ShardInfo.from_json(s, where=where) for s in raw_shards)
        if sum(s.bytes + s.index_bytes for s in shards) > MAX_TOTAL:
            raise DatasetError(f"{where}: the shards add up to more than {MAX_TOTAL} bytes")
        names = [s.name for s in shards] + [s.index_name for s in shards]
        if len(set(names)) != len(names):
            raise DatasetError(f"{where}: two shard entries share a file name")
        return cls(
            dtype=dtype,
            vocab_size=vocab_size,
            eos_id=eos_id,
            tokenizer=tokenizer,
            shards=shards,
            fingerprint=fingerprint,
            extra=dict(obj.get("extra") or {}),
            fingerprint_version=scheme,
        )


def compute_fingerprint(
    dtype: str,
    vocab_size: int,
    eos_id: int,
    shards: list[ShardInfo],
    *,
    scheme: int = FINGERPRINT_VERSION,
) -> str:
    """Content identity (docs/format.md A.4): settings plus, per shard in order, its token
    and document counts and the checksums of its token file and (scheme 2) its document
    index. Scheme 1 is the legacy one, kept to read datasets written before: it leaves the
    document index out, so moving a document boundary did not change it."""
    obj: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
    }
    if scheme == 1:
        obj["shards"] = [[s.tokens, s.docs, s.checksum] for s in shards]
    elif scheme == 2:
        obj["fingerprint_version"] = 2
        obj["shards"] = [[s.tokens, s.docs, s.checksum, s.index_checksum] for s in shards]
    else:
        raise DatasetError(f"fingerprint scheme {scheme!r} is not one of {FINGERPRINT_VERSIONS}")
    return canonical_digest(obj)


def read_manifest(store: Store) -> Manifest:
    """Read and validate ``manifest.json``; errors name the file and the fix."""
    where = store.display(MANIFEST_NAME)
    if not store.exists(MANIFEST_NAME):
        raise DatasetError(
            f"{where} does not exist: {store.url} is not a dataset, or it was never completed "
            f"(the manifest is written last); run `steadytrain tokenize ... --out {store.url}`"
        )
    check_small_file(store, MANIFEST_NAME, MAX_MANIFEST_BYTES, what="manifest")
    raw = store.read_bytes(MANIFEST_NAME)
    manifest = parse_manifest(raw, where=where)
    expected = compute_fingerprint(
        manifest.dtype,
        manifest.vocab_size,
        manifest.eos_id,
        list(manifest.shards),
        scheme=manifest.fingerprint_version,
    )
    if manifest.fingerprint != expected:
        raise DatasetError(
            f"{where}: fingerprint {_short(manifest.fingerprint)} does not match its shard list "
            f"({expected}); the manifest was edited or damaged (a changed shard, document "
            f"index or checksum): run `steadytrain verify {store.url}`, restore the dataset or "
            f"re-tokenize it"
        )
    # After the fingerprint: an edit that forgot to update it is reported as such.
    for shard in manifest.shards:
        shard.check_sizes(manifest.itemsize, where=where)
    return manifest


def parse_manifest(raw: bytes, *, where: str) -> Manifest:
    """Parse and validate manifest bytes (not the fingerprint: ``read_manifest`` checks it).
    Any input raises only ``DatasetError`` naming ``where``."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise DatasetError(f"{where}: nested too deeply to be a manifest; it is damaged") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or a 5000-digit int
        raise DatasetError(f"{where}: not valid JSON ({exc}); the manifest is damaged") from exc
    return Manifest.from_json(obj, where=where)


def write_manifest(store: Store, manifest: Manifest) -> None:
    """Publish the manifest atomically. Call this last, after every shard is published."""
    data = json.dumps(manifest.to_json(), indent=1, sort_keys=False).encode()
    store.write_bytes_atomic(MANIFEST_NAME, data + b"\n")
