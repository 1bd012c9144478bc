"""Import a Megatron-LM ``MMapIndexedDataset`` (``PREFIX.bin`` + ``PREFIX.idx``) as a dataset.

The ``.idx`` layout (all little-endian), as written by Megatron-LM's ``_IndexWriter``:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
              8 uint16)
    u64       sequence count S
    u64       document count D (entries of the document index: number of documents + 1)
    i32 × S   sequence lengths (tokens)
    i64 × S   sequence pointers (byte offsets into .bin)
    i64 × D   document index: sequence indices where documents start; first 0, last S
    i8  × S   optional (multimodal datasets): sequence modes

The ``.bin`` is the token ids back to back. When it holds uint16 ids, or int32 ids (all of
them non-negative, so byte-identical to uint32), and the sequences are contiguous from byte 0,
the file *is* a v1 shard: it is hard-linked into the dataset (no bytes rewritten) when source
and destination share a file system, else copied; other dtypes are converted. Only a new
document index (u64 document ends) is written.

Megatron's preprocessing appends an end-of-document token only with ``--append-eod``: the
import checks whether every document ends with the EOS id and records it in the manifest's
``extra.megatron.docs_end_with_eos``; readers that rely on EOS separators must check it.
Empty documents (no tokens) are dropped (v1 document ends are strictly increasing) and
counted in ``extra.megatron.empty_docs_dropped``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import struct
import time
from typing import Any

import numpy as np
import xxhash

from steadytrain.data.ingest.output import Output, result_json
from steadytrain.data.ingest.progress import NullProgress
from steadytrain.data.ingest.tokenizer import TOKENIZER_FILE, resolve_tokenizer
from steadytrain.data.ingest.writer import shard_names
from steadytrain.data.read.format import (
    Manifest,
    ShardInfo,
    compute_fingerprint,
    dtype_for_vocab,
    write_manifest,
)
from steadytrain.errors import ConfigError, DatasetError
from steadytrain.storage.publish import Hasher, checksum_bytes

__all__ = [
    "MEGATRON_MAGIC",
    "MEGATRON_DTYPES",
    "MegatronIndex",
    "read_megatron_index",
    "import_megatron",
]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}  # fmt: skip
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
SCAN_TOKENS = 1 << 22  # tokens per chunk when scanning or converting the .bin


@dataclasses.dataclass
class MegatronIndex:
    path: str
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def read_megatron_index(path: str) -> MegatronIndex:
    """Parse and validate a Megatron ``.idx`` file; errors name the file and what is wrong."""
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (FileNotFoundError, ValueError) as exc:
        raise DatasetError(f"{path}: cannot read the Megatron index ({exc})") from None
    if raw.size < _HEADER.size:
        raise DatasetError(f"{path}: {raw.size} bytes, too short for a Megatron index header")
    magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(raw[: _HEADER.size]))
    if magic != MEGATRON_MAGIC:
        raise DatasetError(f"{path}: not a Megatron MMapIndexedDataset index (bad magic {magic!r})")
    if version != 1:
        raise DatasetError(f"{path}: Megatron index version {version} is not supported (only 1)")
    if code not in MEGATRON_DTYPES:
        raise DatasetError(f"{path}: unknown Megatron dtype code {code}")
    body = _HEADER.size + n_seq * 4 + n_seq * 8 + n_doc * 8
    if raw.size not in (body, body + n_seq):
        raise DatasetError(
            f"{path}: {raw.size} bytes, but {n_seq} sequences and {n_doc} document entries "
            f"need {body} (or {body + n_seq} with sequence modes); the index is truncated or damaged"
        )
    off = _HEADER.size
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=off)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
    doc_idx = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
    if raw.size == body + n_seq and np.any(np.frombuffer(raw, np.int8, n_seq, body)):
        raise DatasetError(f"{path}: a multimodal Megatron dataset (non-text sequence modes)")
    if n_doc < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        raise DatasetError(
            f"{path}: the document index must rise from 0 to the sequence count {n_seq}"
        )
    if np.any(lengths < 0):
        raise DatasetError(f"{path}: negative sequence length")
    return MegatronIndex(path, np.dtype(MEGATRON_DTYPES[code]), lengths, pointers, doc_idx)


@dataclasses.dataclass
class ImportResult:
    url: str
    manifest: Manifest
    up_to_date: bool
    seconds: float
    linked: bool

    def to_json(self) -> dict[str, Any]:
        return {
            **result_json(self.url, self.manifest, self.up_to_date, self.seconds),
            "hardlinked": self.linked,
            "extra": self.manifest.extra,
        }


def _scan(tokens: np.ndarray, progress: NullProgress) -> tuple[str, int, int]:
    """xxh3-64 of the token bytes and the min / max id, one chunk at a time."""
    h = Hasher()
    lo, hi = 0, -1
    for start in range(0, tokens.size, SCAN_TOKENS):
        block = np.ascontiguousarray(tokens[start : start + SCAN_TOKENS])
        h.update(block)
        lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
        progress.update((start + block.size) * tokens.itemsize)
    return h.hexdigest(), lo, hi


def import_megatron(
    prefix: str,
    out: str,
    *,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    progress: NullProgress | None = None,
) -> ImportResult:
    """Turn ``PREFIX.bin``/``PREFIX.idx`` into a v1 dataset at ``out``, reusing the .bin."""
    t0 = time.perf_counter()
    progress = progress or NullProgress()
    bin_path, idx_path = f"{prefix}.bin", f"{prefix}.idx"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise DatasetError(f"{path} does not exist; --from-megatron takes the common PREFIX")
    index = read_megatron_index(idx_path)
    if not np.issubdtype(index.dtype, np.integer):
        raise DatasetError(f"{idx_path}: token dtype {index.dtype} is not an integer type")
    itemsize = index.dtype.itemsize
    total = index.num_tokens
    if total == 0:
        raise DatasetError(f"{idx_path}: the Megatron dataset holds no tokens; nothing was written")
    expected_ptr = np.concatenate(([0], np.cumsum(index.sequence_lengths[:-1], dtype=np.int64)))
    if not np.array_equal(index.sequence_pointers, expected_ptr * itemsize):
        raise DatasetError(f"{idx_path}: sequences are not stored back to back in {bin_path}")
    bin_size = os.path.getsize(bin_path)
    if bin_size < total * itemsize:
        raise DatasetError(
            f"{bin_path}: {bin_size} bytes, the index needs {total * itemsize}; truncated .bin"
        )

    spec = resolve_tokenizer(tokenizer) if tokenizer else None
    if isinstance(spec, int):
        raise ConfigError("--from-megatron cannot train a tokenizer; give a tokenizer.json path")
    st_bin, st_idx = os.stat(bin_path), os.stat(idx_path)
    recipe = xxhash.xxh3_128_hexdigest(
        json.dumps(
            [os.path.abspath(prefix), st_bin.st_size, st_bin.st_mtime_ns, st_idx.st_size,
             st_idx.st_mtime_ns, tokenizer, spec.file_hash if spec else None, vocab_size, eos_id],
        ).encode()
    )  # fmt: skip
    output = Output(out)
    if output.existing is not None:
        if output.existing.extra.get("recipe") == recipe:
            return ImportResult(out, output.existing, True, time.perf_counter() - t0, False)
        raise output.different_dataset_error(None, "imported from other files or settings")

    tokens = np.memmap(bin_path, dtype=index.dtype.newbyteorder("<"), mode="r", shape=(total,))
    progress.start(total * itemsize, "scan .bin")
    try:
        src_checksum, lo, hi = _scan(tokens, progress)
    finally:
        progress.stop()
    if lo < 0:
        raise DatasetError(f"{bin_path}: negative token id {lo}")
    if spec is not None:
        vocab_size, eos_id = spec.vocab_size, spec.eos_id
    seq_ends = np.cumsum(index.sequence_lengths, dtype=np.int64)
    doc_ends = np.concatenate(([0], seq_ends))[index.document_indices[1:]]
    keep = np.diff(np.concatenate(([0], doc_ends))) > 0
    ends = doc_ends[keep].astype("<u8")
    last = np.asarray(tokens[ends.astype(np.int64) - 1])
    if eos_id is None:
        if np.all(last == last[0]):
            eos_id = int(last[0])  # every document ends with the same id: Megatron's EOD
        else:
            raise ConfigError(
                f"{bin_path}: documents do not end with a common EOD token, so the EOS id "
                f"cannot be inferred; pass --eos-id ID (or --tokenizer tokenizer.json)"
            )
    vocab_size = vocab_size if vocab_size is not None else max(hi, eos_id) + 1
    if hi >= vocab_size:
        raise DatasetError(f"{bin_path}: token id {hi} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= eos_id < vocab_size:
        raise ConfigError(f"--eos-id {eos_id} is outside the vocabulary [0, {vocab_size})")

    # Keep the source width when its bytes already are valid v1 ids (no rewrite): uint16 as
    # is, int32 as uint32 (ids are non-negative, so the bytes are identical).
    if index.dtype in (np.uint16, np.int32):
        dtype = np.dtype("uint16" if index.dtype == np.uint16 else "uint32")
        reusable = bin_size == total * itemsize
    else:
        dtype, reusable = np.dtype(dtype_for_vocab(vocab_size)), False
    name, index_name = shard_names(0)
    store = output.begin()
    linked = False
    try:
        if spec is not None and spec.json_text is not None:
            store.write_bytes_atomic(TOKENIZER_FILE, spec.json_text.encode())
        target = store.local_path(name)
        if reusable and target is not None:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.link(bin_path, target)
                linked = True
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
        checksum = src_checksum if reusable else None
        if not linked:
            h = Hasher()
            with store.open_write_atomic(name) as f:
                for start in range(0, total, SCAN_TOKENS):
                    block = np.ascontiguousarray(
                        tokens[start : start + SCAN_TOKENS], dtype=dtype.newbyteorder("<")
                    )
                    f.write(memoryview(block).cast("B"))
                    h.update(block)
            checksum = h.hexdigest()
        store.write_bytes_atomic(index_name, ends.tobytes())
        shard = ShardInfo(
            name=name,
            bytes=total * dtype.itemsize,
            tokens=total,
            docs=int(ends.size),
            checksum=checksum,
            index_name=index_name,
            index_bytes=int(ends.size) * 8,
            index_checksum=checksum_bytes(ends),
        )
        tok_entry: dict[str, Any] = (
            spec.manifest_entry()
            if spec is not None
            else {"type": "megatron", "vocab_size": vocab_size, "eos_id": eos_id}
        )
        extra = {
            "recipe": recipe,
            "created_by": "steadytrain tokenize --from-megatron",
            "megatron": {
                "prefix": os.path.abspath(prefix),
                "dtype": index.dtype.name,
                "sequences": int(index.sequence_lengths.size),
                "documents": int(index.document_indices.size - 1),
                "empty_docs_dropped": int((~keep).sum()),
                "docs_end_with_eos": bool(np.all(last == eos_id)),
                "hardlinked": linked,
            },
        }
        manifest = Manifest(
            dtype=dtype.name,
            vocab_size=int(vocab_size),
            eos_id=int(eos_id),
            tokenizer=tok_entry,
            shards=(shard,),
            fingerprint=compute_fingerprint(dtype.name, int(vocab_size), int(eos_id), [shard]),
            extra=extra,
        )
        write_manifest(store, manifest)
        output.commit()
    except BaseException:
        output.discard()
        raise
    return ImportResult(out, manifest, False, time.perf_counter() - t0, linked)
