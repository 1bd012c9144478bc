"""Tokenizers for ``steadytrain tokenize``: ``bytes``, a local ``tokenizer.json``, ``train:VOCAB``.

A ``TokenizerSpec`` is a small picklable value (kind, JSON text, vocabulary size, EOS id) sent
to worker processes; each worker builds its own ``Encoder`` from it once. Encoders turn a list
of documents into one concatenated id array plus per-document lengths, EOS appended to each.

``train:VOCAB`` trains on a bounded sample (``sample_for_training``), not on the whole input:
Hugging Face's BPE trainer holds every distinct pre-token with its pair positions, and one
long document costs far more than its size (measured on 108 MB of Python sources: 414 MiB
peak RSS as 7,014 files, 9.4 GiB as one file). The sample is a fixed budget of bytes in
pieces of at most ``PIECE_CHARS`` characters, chosen by a hash of their text, so it is spread
over every input file and the same input and budget always train the same tokenizer.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from steadytrain.data.ingest.progress import NullProgress
from steadytrain.data.ingest.sources import DecodeStats, SourceFile, iter_documents
from steadytrain.data.read.format import dtype_for_vocab
from steadytrain.errors import ConfigError
from steadytrain.storage.publish import checksum_bytes

__all__ = [
    "TokenizerSpec",
    "Encoder",
    "resolve_tokenizer",
    "bytes_spec",
    "hf_spec",
    "train_bpe",
    "TrainingSample",
    "sample_for_training",
    "check_sample_budget",
    "train_on_sources",
    "DEFAULT_SAMPLE_BYTES",
    "MIN_SAMPLE_BYTES",
    "TOKENIZER_FILE",
    "stored_tokenizer_hash",
]

TOKENIZER_FILE = "tokenizer.json"
BYTES_VOCAB = 257
BYTES_EOS = 256
# Special tokens recognised as end-of-document, most common first.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
DEFAULT_EOS = "<|endoftext|>"
# train:VOCAB reads at most this many bytes of text by default: enough for a stable 8k-32k
# vocabulary, and it keeps the trainer's peak memory in the hundreds of MB (docs/format.md).
DEFAULT_SAMPLE_BYTES = 64 << 20
# A document longer than this is sampled as pieces (cut after a newline where one is near):
# the trainer's memory grows with the longest text it is given, and a sample of whole
# multi-megabyte files would be a handful of files, not a spread over the input.
PIECE_CHARS = 64 << 10
# Sixteen pieces at least: the sample stops at the first piece (in hash order) that does
# not fit, so a budget of a few pieces could waste most of itself.
MIN_SAMPLE_BYTES = 16 * PIECE_CHARS
_SAMPLE_SEED = 0x5EED_B9E  # fixed: the sample is part of the recipe, never random


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to encode, and what the manifest records about the tokenizer."""

    kind: str  # "bytes" | "huggingface"
    vocab_size: int
    eos_id: int
    json_text: str | None = None  # the tokenizer.json stored with the dataset
    source: str = "bytes"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(dtype_for_vocab(self.vocab_size))

    @property
    def file_hash(self) -> str | None:
        if self.json_text is None:
            return None
        return stored_tokenizer_hash(self.json_text.encode())

    def manifest_entry(self) -> dict[str, Any]:
        """The manifest's ``tokenizer`` object."""
        if self.kind == "bytes":
            return {"type": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}
        return {
            "type": "huggingface",
            "source": self.source,
            "file": TOKENIZER_FILE,
            "hash": self.file_hash,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
        }


def bytes_spec() -> TokenizerSpec:
    """UTF-8 bytes as ids 0..255, EOS = 256: needs no file and no training."""
    return TokenizerSpec("bytes", BYTES_VOCAB, BYTES_EOS, None, "bytes")


def _eos_of(tok: Any) -> int | None:
    vocab = tok.get_vocab(with_added_tokens=True)
    for name in EOS_CANDIDATES:
        if name in vocab:
            return int(vocab[name])
    return None


def hf_spec(json_text: str, source: str) -> TokenizerSpec:
    """A Hugging Face tokenizer; EOS is its end-of-text token, added when it has none."""
    from tokenizers import AddedToken, Tokenizer

    try:
        tok = Tokenizer.from_str(json_text)
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ConfigError(f"{source}: not a Hugging Face tokenizer.json ({exc})") from exc
    eos = _eos_of(tok)
    if eos is None:
        # No end-of-text token: add one, so documents stay separable in the token stream.
        tok.add_special_tokens([AddedToken(DEFAULT_EOS, special=True)])
        json_text = tok.to_str()
        eos = _eos_of(tok)
        assert eos is not None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = max(vocab, eos + 1)
    return TokenizerSpec("huggingface", int(vocab), int(eos), json_text, source)


@dataclasses.dataclass
class TrainingSample:
    """The texts a BPE is trained on, and what they are out of the input."""

    texts: list[str]  # pieces, in hash order (so the trainer always sees the same sequence)
    sample_bytes: int  # UTF-8 bytes of ``texts``, at most the budget
    input_bytes: int  # UTF-8 bytes of every piece read
    pieces: int
    input_pieces: int

    def manifest_entry(self, budget: int) -> dict[str, int]:
        """What the manifest's ``extra.tokenizer_training`` records."""
        return {
            "sample_budget_bytes": budget,
            "sample_bytes": self.sample_bytes,
            "sample_pieces": self.pieces,
            "input_text_bytes": self.input_bytes,
            "input_pieces": self.input_pieces,
        }


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of at most ``PIECE_CHARS`` characters, each cut after the last
    newline of its window when there is one (a pre-token rarely spans lines)."""
    start, n = 0, len(text)
    while n - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        cut = text.rfind("\n", start + PIECE_CHARS // 2, end)
        end = cut + 1 if cut >= 0 else end
        yield text[start:end]
        start = end
    yield text[start:]


def check_sample_budget(budget_bytes: int) -> None:
    """Refuse a sample budget too small to train on, naming the flag and the fix."""
    if budget_bytes < MIN_SAMPLE_BYTES:
        raise ConfigError(
            f"--tokenizer-sample-bytes {budget_bytes}: too small to train a tokenizer on; "
            f"use at least {MIN_SAMPLE_BYTES} (1 MiB; the default is {DEFAULT_SAMPLE_BYTES})"
        )


def sample_for_training(docs: Iterable[str], budget_bytes: int) -> TrainingSample:
    """A deterministic sample of at most ``budget_bytes`` UTF-8 bytes of ``docs``' text.

    Every document is cut into pieces (``_pieces``), and each piece gets a keyed 64-bit
    hash of its text. The sample is every piece whose hash is below the smallest hash at
    which the pieces' total (in hash order) would exceed the budget: one pass, holding at
    most the budget. It depends on the pieces' content only, not on their order or on which
    file comes first, so it is spread evenly over all inputs; an input within the budget is
    kept whole.
    """
    check_sample_budget(budget_bytes)
    heap: list[tuple[int, int, str]] = []  # (-hash, size, piece): the largest hash on top
    limit = 1 << 64  # pieces hashing to this or above are out of the sample for good
    kept = seen = pieces = 0
    for doc in docs:
        for piece in _pieces(doc):
            data = piece.encode("utf-8", errors="surrogatepass")  # JSON may hold lone ones
            seen += len(data)
            pieces += 1
            h = xxhash.xxh3_64_intdigest(data, seed=_SAMPLE_SEED)
            if h >= limit:
                continue
            heapq.heappush(heap, (-h, len(data), piece))
            kept += len(data)
            while kept > budget_bytes:  # drop the largest hash (and its equals) for good
                limit = -heap[0][0]
                while heap and -heap[0][0] >= limit:
                    kept -= heapq.heappop(heap)[1]
    heap.sort(reverse=True)  # smallest hash first: one order for one sample
    return TrainingSample([p for _, _, p in heap], kept, seen, len(heap), pieces)


def train_bpe(
    texts: Iterable[str], vocab_size: int, *, show_progress: bool = False
) -> TokenizerSpec:
    """Train a byte-level BPE (Hugging Face ``tokenizers``) on ``texts``; EOS = id 0.

    ``texts`` should be bounded (``sample_for_training``): the trainer's memory grows with
    them. ``show_progress`` shows the trainer's own bars on a terminal (stderr), but it
    also prints blank lines on stdout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(
            f"train:{vocab_size}: a byte-level BPE needs vocab >= 257 (256 bytes + EOS)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[DEFAULT_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    return hf_spec(tok.to_str(), f"train:{vocab_size}")


def train_on_sources(
    sources: Sequence[SourceFile],
    vocab_size: int,
    text_field: str,
    budget: int,
    progress: NullProgress | None = None,
) -> tuple[TokenizerSpec, dict[str, int]]:
    """Train ``train:VOCAB`` on a bounded sample of the input (``sample_for_training``),
    showing the read and then the trainer's own bars; returns the spec and what the
    manifest records about the sample."""
    bar = progress or NullProgress()
    stats = DecodeStats()

    def reported(docs: Iterator[str]) -> Iterator[str]:
        last = 0
        for doc in docs:
            yield doc
            if stats.bytes_read - last >= 1 << 20:  # a bar update per MiB, not per document
                last = stats.bytes_read
                bar.update(last)

    bar.start(sum(s.size for s in sources), f"sample for train:{vocab_size}")
    try:
        docs = iter_documents(sources, text_field=text_field, stats=stats)
        sample = sample_for_training(reported(docs), budget)
        bar.update(stats.bytes_read)
    finally:
        bar.stop()
    # The trainer reports nothing to Python (its own bars would print blank lines on
    # stdout, into --json output): the bar shows that it works and for how long.
    bar.start(None, f"train:{vocab_size} on {sample.sample_bytes / 1e6:.1f} MB of text")
    try:
        spec = train_bpe(sample.texts, vocab_size)
    finally:
        bar.stop()
    return spec, sample.manifest_entry(budget)


def resolve_tokenizer(name: str) -> TokenizerSpec | int:
    """``bytes`` or a tokenizer.json path → a spec; ``train:VOCAB`` → the vocabulary size.

    Training needs the input, so the caller trains (``train_bpe``) when this returns an int.
    """
    if name == "bytes":
        return bytes_spec()
    if name.startswith("train:"):
        try:
            return int(name.split(":", 1)[1])
        except ValueError:
            raise ConfigError(
                f"--tokenizer {name!r}: expected train:VOCAB, e.g. train:8192"
            ) from None
    if not os.path.isfile(name):
        raise ConfigError(
            f"--tokenizer {name!r}: not 'bytes', 'train:VOCAB' or an existing tokenizer.json file"
        )
    with open(name, encoding="utf-8") as f:
        return hf_spec(f.read(), os.path.abspath(name))


class Encoder:
    """Built once per worker from a spec; ``encode`` is the only hot path."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.dtype = spec.dtype
        self._tok = None
        if spec.kind == "huggingface":
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(spec.json_text)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated ids (EOS after every document) and each document's length."""
        eos = self.spec.eos_id
        if self._tok is None:
            parts = [t.encode("utf-8", errors="replace") for t in texts]
            lengths = np.fromiter((len(p) + 1 for p in parts), dtype=np.int64, count=len(parts))
            raw = np.frombuffer(b"".join(p + b"\x00" for p in parts), dtype=np.uint8)
            out = raw.astype(self.dtype)
            out[np.cumsum(lengths) - 1] = eos  # the placeholder byte after each document
            return out, lengths
        try:
            encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        except Exception:  # lone surrogates (from JSON escapes) are refused: replace them
            texts = [t.encode("utf-8", errors="replace").decode("utf-8") for t in texts]
            encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        ids = [e.ids for e in encs]
        lengths = np.fromiter((len(i) + 1 for i in ids), dtype=np.int64, count=len(ids))
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        pos = 0
        for seq in ids:
            n = len(seq)
            out[pos : pos + n] = seq
            out[pos + n] = eos
            pos += n + 1
        return out, lengths


# The hash the manifest records for a stored tokenizer.json: the one file checksum
# (``xxh3_64:<hex>`` of its bytes), under the name verify and the manifest code know it by.
stored_tokenizer_hash = checksum_bytes
