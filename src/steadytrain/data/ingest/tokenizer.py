"""Tokenizers for ``steadytrain tokenize``: ``bytes``, a local ``tokenizer.json``, ``train:VOCAB``.

A ``TokenizerSpec`` is a small picklable value (kind, JSON text, vocabulary size, EOS id) sent
to worker processes; each worker builds its own ``Encoder`` from it once. Encoders turn a list
of documents into one concatenated id array plus per-document lengths, EOS appended to each.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

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
    "TOKENIZER_FILE",
    "stored_tokenizer_hash",
]

TOKENIZER_FILE = "tokenizer.json"
BYTES_VOCAB = 257
BYTES_EOS = 256
# Special tokens recognised as end-of-document, most common first.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
DEFAULT_EOS = "<|endoftext|>"


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


def train_bpe(texts: Iterable[str], vocab_size: int) -> TokenizerSpec:
    """Train a byte-level BPE (Hugging Face ``tokenizers``) on ``texts``; EOS = id 0."""
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
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return hf_spec(tok.to_str(), f"train:{vocab_size}")


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
