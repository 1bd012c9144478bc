"""Write a token-shard dataset: shards published one by one, the manifest last.

Documents are appended in order; a shard is closed once it holds at least ``shard_tokens``
tokens, always at a document boundary, so shard boundaries depend only on the token stream
(never on how many workers produced it). Memory is bounded by one write buffer.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from steadytrain.data.read.format import (
    Manifest,
    ShardInfo,
    compute_fingerprint,
    dtype_for_vocab,
    write_manifest,
)
from steadytrain.errors import DatasetError
from steadytrain.storage.publish import Hasher
from steadytrain.storage.store import Store

__all__ = ["DatasetWriter", "shard_names"]

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 shards


def shard_names(index: int) -> tuple[str, str]:
    stem = f"shards/shard-{index:05d}"
    return f"{stem}.tokens", f"{stem}.idx"


class _OpenShard:
    """One shard being written: token file and index file, checksummed as they stream."""

    def __init__(self, store: Store, index: int, dtype: np.dtype) -> None:
        self.name, self.index_name = shard_names(index)
        self.dtype = dtype
        self._stack = contextlib.ExitStack()
        self._tokens_f = self._stack.enter_context(store.open_write_atomic(self.name))
        self._index_f = self._stack.enter_context(store.open_write_atomic(self.index_name))
        self._sum = Hasher()
        self._index_sum = Hasher()
        self.tokens = 0
        self.docs = 0

    def write(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<"))
        ends = (self.tokens + np.cumsum(doc_lengths, dtype=np.uint64)).astype("<u8")
        self._tokens_f.write(memoryview(data).cast("B"))
        self._index_f.write(memoryview(ends).cast("B"))
        self._sum.update(data)
        self._index_sum.update(ends)
        self.tokens += int(data.size)
        self.docs += int(doc_lengths.size)

    def publish(self) -> ShardInfo:
        self._stack.close()  # closes both files: each publishes atomically
        return ShardInfo(
            name=self.name,
            bytes=self.tokens * self.dtype.itemsize,
            tokens=self.tokens,
            docs=self.docs,
            checksum=self._sum.hexdigest(),
            index_name=self.index_name,
            index_bytes=self.docs * 8,
            index_checksum=self._index_sum.hexdigest(),
        )

    def abort(self) -> None:
        # Leaving the contexts with an exception discards the temporary files.
        with contextlib.suppress(RuntimeError):
            self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)


class DatasetWriter:
    """Append documents (token arrays ending in EOS) and publish a dataset.

    Use as a context manager: a clean exit publishes the manifest, an exception leaves no
    manifest (so nothing half-written is ever accepted as a dataset).
    """

    def __init__(
        self,
        dest: str | Store,
        *,
        vocab_size: int,
        eos_id: int,
        tokenizer: dict[str, Any],
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if shard_tokens < 1:
            raise DatasetError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.store = dest if isinstance(dest, Store) else Store(dest)
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        self.shard_tokens = shard_tokens
        self.extra = extra or {}
        self.dtype = np.dtype(dtype_for_vocab(vocab_size))
        self.shards: list[ShardInfo] = []
        self._open: _OpenShard | None = None
        self.store.makedirs("shards")

    def add_documents(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append documents given as one concatenated array and their lengths (EOS included)."""
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        if int(doc_lengths.sum()) != tokens.size:
            raise DatasetError("doc_lengths do not add up to the number of tokens")
        if tokens.size and (int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0):
            bad = int(tokens.max()) if int(tokens.max()) >= self.vocab_size else int(tokens.min())
            raise DatasetError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        start, tok_pos = 0, 0
        while start < doc_lengths.size:
            if self._open is None:
                self._open = _OpenShard(self.store, len(self.shards), self.dtype)
            room = self.shard_tokens - self._open.tokens
            # Take documents until the shard reaches its target size (at least one document).
            cum = np.cumsum(doc_lengths[start:])
            take = min(int(np.searchsorted(cum, room, side="left")) + 1, cum.size)
            end_pos = tok_pos + int(cum[take - 1])
            self._open.write(tokens[tok_pos:end_pos], doc_lengths[start : start + take])
            start, tok_pos = start + take, end_pos
            if self._open.tokens >= self.shard_tokens:
                self.shards.append(self._open.publish())
                self._open = None

    def add_document(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size]))

    def close(self) -> Manifest:
        """Publish the last shard, then the manifest (last of all)."""
        if self._open is not None and self._open.tokens:
            self.shards.append(self._open.publish())
        elif self._open is not None:
            self._open.abort()
        self._open = None
        if not self.shards:
            raise DatasetError("no documents were written: the input is empty")
        manifest = Manifest(
            dtype=self.dtype.name,
            vocab_size=self.vocab_size,
            eos_id=self.eos_id,
            tokenizer=self.tokenizer,
            shards=tuple(self.shards),
            fingerprint=compute_fingerprint(
                self.dtype.name, self.vocab_size, self.eos_id, self.shards
            ),
            extra=self.extra,
        )
        write_manifest(self.store, manifest)
        return manifest

    def abort(self) -> None:
        if self._open is not None:
            self._open.abort()
            self._open = None

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
