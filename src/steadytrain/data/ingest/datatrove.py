"""Import datatrove's tokenized output (``*.ds`` + ``*.ds.index`` + ``*.ds.metadata``).

datatrove (``datatrove.pipeline.tokens``: ``DocumentTokenizer`` and
``DocumentTokenizerMerger``, both through ``TokenizedFile``) writes, per output file ``X.ds``:

    X.ds           token ids back to back, little-endian, 2 bytes (uint16) or 4 (uint32), no
                   header: ``struct.pack("<%dH" / "<%dI", *ids)``
    X.ds.index     u64 little-endian exclusive document ends in tokens, one per document (no
                   header; ``save_index=True``, the default)
    X.ds.metadata  text: ``TOKENIZER_NAME_OR_PATH|TOKEN_SIZE``, then the token count, then the
                   count in words (``save_final_metadata=True``, the default)
    X.ds.loss      optional one byte per token loss mask (not imported)

That is byte for byte a v1 shard and its document index, so each non-empty ``.ds`` becomes
one shard, hard-linked into the dataset when source and destination share a file system
(else copied; never rewritten). The index is rewritten only when it holds empty documents
(datatrove keeps them as repeated ends; v1 ends rise strictly). The EOS token is in the data
only if datatrove was run with ``eos_token`` (or a tokenizer whose post-processor adds it):
``extra.datatrove.docs_end_with_eos`` records whether every document ends with it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from typing import Any

import numpy as np
import xxhash

from steadytrain.data.ingest.megatron import SCAN_TOKENS, ImportResult
from steadytrain.data.ingest.output import Output
from steadytrain.data.ingest.progress import NullProgress
from steadytrain.data.ingest.tokenizer import TOKENIZER_FILE, resolve_tokenizer
from steadytrain.data.ingest.writer import shard_names
from steadytrain.data.read.format import Manifest, ShardInfo, compute_fingerprint, write_manifest
from steadytrain.errors import ConfigError, DatasetError
from steadytrain.storage.publish import Hasher, checksum_bytes
from steadytrain.storage.store import Store

__all__ = ["DatatroveFile", "find_datatrove_files", "read_datatrove_file", "import_datatrove"]

TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


@dataclasses.dataclass
class DatatroveFile:
    """One ``.ds`` file, checked against its index (and its metadata, when there is one)."""

    path: str
    token_size: int
    tokenizer: str | None  # the name or path datatrove's metadata records
    ends: np.ndarray  # u64 document ends as datatrove wrote them (may repeat: empty docs)
    loss_file: bool

    @property
    def num_tokens(self) -> int:
        return int(self.ends[-1]) if self.ends.size else 0

    def tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=TOKEN_DTYPES[self.token_size], mode="r")


def find_datatrove_files(path: str) -> list[str]:
    """``path`` itself when it is a ``.ds`` file, else every ``*.ds`` below it, in path order
    (datatrove lists its folders recursively too)."""
    if os.path.isfile(path):
        if not path.endswith(".ds"):
            raise ConfigError(
                f"{path}: --from-datatrove takes a datatrove output folder or one .ds file"
            )
        return [path]
    if not os.path.isdir(path):
        raise DatasetError(f"{path} does not exist; --from-datatrove takes the output folder")
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in files if f.endswith(".ds")]
    if not found:
        raise DatasetError(
            f"{path}: no *.ds files; --from-datatrove takes the folder a datatrove "
            f"DocumentTokenizer or DocumentTokenizerMerger wrote"
        )
    return sorted(found, key=lambda p: os.path.relpath(p, path))


def _read_metadata(path: str) -> tuple[str | None, int, int] | None:
    """(tokenizer name, token size, token count) from ``X.ds.metadata``, or None if absent."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    try:
        # rsplit: datatrove writes "Unknown Tokenizer|2|2" when it had no tokenizer name.
        name, size = lines[0].rsplit("|", 1)
        token_size, count = int(size), int(lines[1])
    except (IndexError, ValueError):
        raise DatasetError(
            f"{path}: not a datatrove metadata file (expected 'TOKENIZER|TOKEN_SIZE' and a "
            f"token count on its first two lines)"
        ) from None
    if token_size not in TOKEN_DTYPES:
        raise DatasetError(f"{path}: token size {token_size} bytes; datatrove writes 2 or 4")
    unknown = name.startswith("Unknown Tokenizer")
    return (None if unknown else name), token_size, count


def read_datatrove_file(path: str, token_size: int | None = None) -> DatatroveFile:
    """Check one ``.ds`` against its ``.index`` and ``.metadata``; errors name the file."""
    meta = _read_metadata(f"{path}.metadata")
    if meta is None and token_size is None:
        raise DatasetError(
            f"{path}.metadata does not exist, so the token width is unknown; pass --token-size "
            f"2 (vocabularies up to 65536) or 4, or re-run datatrove with save_final_metadata=True"
        )
    name, size = (meta[0], meta[1]) if meta else (None, token_size)
    if meta and token_size is not None and token_size != size:
        raise ConfigError(f"--token-size {token_size}, but {path}.metadata says {size}")
    assert size is not None
    index = f"{path}.index"
    if not os.path.isfile(index):
        raise DatasetError(
            f"{index} does not exist: without it the document boundaries of {path} are lost; "
            f"re-run datatrove's DocumentTokenizer with save_index=True (the default)"
        )
    index_bytes = os.path.getsize(index)
    if index_bytes % 8:
        raise DatasetError(f"{index}: {index_bytes} bytes, not a whole number of u64 document ends")
    ends = np.fromfile(index, dtype="<u8")
    if ends.size and np.any(np.diff(ends.astype(np.int64)) < 0):
        raise DatasetError(f"{index}: document ends go backwards; the index is damaged")
    ds_bytes = os.path.getsize(path)
    need = (int(ends[-1]) if ends.size else 0) * size
    if ds_bytes < need:
        raise DatasetError(
            f"{path}: {ds_bytes} bytes, but {index} ends its last document at "
            f"{need // size} tokens ({need} bytes): the .ds is truncated; re-run datatrove"
        )
    if ds_bytes > need:
        raise DatasetError(
            f"{path}: {ds_bytes} bytes, more than the {need} its index {index} accounts for: the "
            f"index is truncated or from another run; re-run datatrove"
        )
    if meta and meta[2] != need // size:
        raise DatasetError(
            f"{path}.metadata counts {meta[2]} tokens but {path} holds {need // size}: they are "
            f"from different runs; re-run datatrove"
        )
    return DatatroveFile(path, size, name, ends, os.path.isfile(f"{path}.loss"))


def _scan(f: DatatroveFile, progress: NullProgress) -> tuple[str, int, int]:
    """xxh3-64 of the token bytes (the shard checksum, as the bytes are kept) and min / max id."""
    tokens, h = f.tokens(), Hasher()
    lo, hi = 0, -1
    for start in range(0, tokens.size, SCAN_TOKENS):
        block = np.ascontiguousarray(tokens[start : start + SCAN_TOKENS])
        h.update(block)
        lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
        progress.update(block.nbytes)
    return h.hexdigest(), lo, hi


def _recipe(path: str, files: list[DatatroveFile], settings: list[Any]) -> str:
    stats = []
    for f in files:
        for p in (f.path, f"{f.path}.index", f"{f.path}.metadata"):
            st = os.stat(p) if os.path.exists(p) else None
            stats.append([p, st.st_size, st.st_mtime_ns] if st else [p, None, None])
    return xxhash.xxh3_128_hexdigest(json.dumps([os.path.abspath(path), stats, settings]).encode())


def import_datatrove(
    path: str,
    out: str,
    *,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    token_size: int | None = None,
    progress: NullProgress | None = None,
) -> ImportResult:
    """Turn datatrove's tokenized ``.ds`` files under ``path`` into a v1 dataset at ``out``."""
    t0 = time.perf_counter()
    progress = progress or NullProgress()
    files = [read_datatrove_file(p, token_size) for p in find_datatrove_files(path)]
    widths = {f.token_size for f in files}
    names = {f.tokenizer for f in files}
    if len(widths) > 1 or len(names) > 1:
        raise DatasetError(
            f"{path}: the .ds files were written with different tokenizers or token sizes "
            f"({sorted(map(str, names))}, {sorted(widths)} bytes); import each run separately"
        )
    size, source_tokenizer = widths.pop(), names.pop()
    kept = [f for f in files if f.num_tokens > 0]  # v1 shards hold at least one document
    if not kept:
        raise DatasetError(f"{path}: the datatrove output holds no tokens; nothing was written")
    spec = resolve_tokenizer(tokenizer) if tokenizer else None
    if isinstance(spec, int):
        raise ConfigError("--from-datatrove cannot train a tokenizer; give a tokenizer.json path")
    settings = [tokenizer, spec.file_hash if spec else None, vocab_size, eos_id, size]
    recipe = _recipe(path, files, settings)
    output = Output(out)
    if output.existing is not None:
        if output.existing.extra.get("recipe") == recipe:
            return ImportResult(out, output.existing, True, time.perf_counter() - t0, False)
        raise output.different_dataset_error(None, "imported from other files or settings")

    progress.start(sum(f.num_tokens for f in kept) * size, "scan .ds")
    try:
        scans = [_scan(f, progress) for f in kept]
    finally:
        progress.stop()
    if spec is not None:
        vocab_size, eos_id = spec.vocab_size, spec.eos_id
    hi = max(s[2] for s in scans)
    # Document ends as v1 wants them: strictly rising (datatrove repeats an end for an empty
    # document), and the last token of each document, to find or check the EOS id.
    v1_ends = [np.unique(f.ends[f.ends > 0]) for f in kept]
    last = np.concatenate([np.asarray(f.tokens()[e.astype(np.int64) - 1]) for f, e in zip(kept, v1_ends, strict=True)])  # fmt: skip
    if eos_id is None:
        if np.all(last == last[0]):
            eos_id = int(last[0])  # every document ends with the same id: datatrove's eos_token
        else:
            raise ConfigError(
                f"{path}: documents do not end with a common EOS token (datatrove ran without "
                f"eos_token?), so the EOS id cannot be inferred; pass --eos-id ID or "
                f"--tokenizer tokenizer.json"
            )
    vocab_size = vocab_size if vocab_size is not None else max(hi, eos_id) + 1
    if hi >= vocab_size:
        bad = kept[next(i for i, s in enumerate(scans) if s[2] >= vocab_size)].path
        raise DatasetError(f"{bad}: token id {hi} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= eos_id < vocab_size:
        raise ConfigError(f"--eos-id {eos_id} is outside the vocabulary [0, {vocab_size})")
    dtype = TOKEN_DTYPES[size]
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ConfigError(
            f"vocabulary {vocab_size} does not fit the {size}-byte ids of {kept[0].path}; "
            f"the --tokenizer / --vocab-size given is not the one datatrove used"
        )

    store = output.begin()
    shards, all_linked = [], True
    try:
        if spec is not None and spec.json_text is not None:
            store.write_bytes_atomic(TOKENIZER_FILE, spec.json_text.encode())
        for i, (f, (checksum, _, _), ends) in enumerate(zip(kept, scans, v1_ends, strict=True)):
            name, index_name = shard_names(i)
            all_linked &= _place(store, f, name, checksum)
            ends = ends.astype("<u8")
            store.write_bytes_atomic(index_name, ends.tobytes())
            shards.append(
                ShardInfo(
                    name=name,
                    bytes=f.num_tokens * size,
                    tokens=f.num_tokens,
                    docs=int(ends.size),
                    checksum=checksum,
                    index_name=index_name,
                    index_bytes=int(ends.size) * 8,
                    index_checksum=checksum_bytes(ends),
                )
            )
        tok_entry: dict[str, Any] = (
            spec.manifest_entry()
            if spec is not None
            else {"type": "datatrove", "name": source_tokenizer, "vocab_size": vocab_size, "eos_id": eos_id}
        )  # fmt: skip
        extra = {
            "recipe": recipe,
            "created_by": "steadytrain tokenize --from-datatrove",
            "datatrove": {
                "path": os.path.abspath(path),
                "files": [
                    os.path.relpath(f.path, path) if f.path != path else os.path.basename(path)
                    for f in kept
                ],  # fmt: skip
                "token_size": size,
                "tokenizer": source_tokenizer,
                "documents": int(sum(f.ends.size for f in files)),
                "empty_docs_dropped": int(
                    sum(f.ends.size for f in files) - sum(e.size for e in v1_ends)
                ),  # fmt: skip
                "empty_files_skipped": len(files) - len(kept),
                "docs_end_with_eos": bool(np.all(last == eos_id)),
                "loss_files_ignored": sum(f.loss_file for f in files),
                "hardlinked": all_linked,
            },
        }
        manifest = Manifest(
            dtype=dtype.name,
            vocab_size=int(vocab_size),
            eos_id=int(eos_id),
            tokenizer=tok_entry,
            shards=tuple(shards),
            fingerprint=compute_fingerprint(dtype.name, int(vocab_size), int(eos_id), shards),
            extra=extra,
        )
        write_manifest(store, manifest)
        output.commit()
    except BaseException:
        output.discard()
        raise
    return ImportResult(out, manifest, False, time.perf_counter() - t0, all_linked)


def _place(store: Store, f: DatatroveFile, name: str, checksum: str) -> bool:
    """Hard-link ``f`` as shard ``name`` (True), or copy it, checking the bytes did not change
    since the scan (False)."""
    target = store.local_path(name)
    if target is not None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(f.path, target)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
    tokens, h = f.tokens(), Hasher()
    with store.open_write_atomic(name) as out:
        for start in range(0, tokens.size, SCAN_TOKENS):
            block = np.ascontiguousarray(tokens[start : start + SCAN_TOKENS])
            out.write(memoryview(block).cast("B"))
            h.update(block)
    if h.hexdigest() != checksum:
        raise DatasetError(f"{f.path} changed while it was being imported; run the import again")
    return False
