"""``tokenize``: raw text → a token-shard dataset, in parallel, deterministic, bounded memory.

Pipeline (one main process, ``workers`` encoder processes)::

    list_sources ─ iter_documents ─ chunks of documents ─▶ workers (encode, EOS appended)
                                                            │  results in submission order
    DatasetWriter (shards, checksums, manifest last) ◀──────┘

The main process reads, groups documents into chunks (~1 MiB of text), keeps at most
``2 × workers`` chunks in flight and writes results strictly in input order. Each document is
encoded on its own, so the token stream (and the shard boundaries the writer derives from it,
and so the fingerprint) is the same whatever the number of workers. Memory is bounded by the
in-flight chunks, one write buffer and a fixed heap slack per encoder (``_MemoryTrimmer``),
whatever the corpus size (a single document is held whole: one huge text file is one huge
document). ``train:VOCAB`` first reads the input once and trains on a bounded, deterministic
sample of it (``tokenizer.train_on_sources``), so training memory does not grow with it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from steadytrain.data.ingest.output import Output, result_json
from steadytrain.data.ingest.progress import NullProgress
from steadytrain.data.ingest.sources import (
    DecodeStats,
    Skipped,
    SourceFile,
    iter_documents,
    list_sources,
)
from steadytrain.data.ingest.tokenizer import (
    DEFAULT_SAMPLE_BYTES,
    TOKENIZER_FILE,
    Encoder,
    TokenizerSpec,
    check_sample_budget,
    resolve_tokenizer,
    train_on_sources,
)
from steadytrain.data.ingest.writer import DEFAULT_SHARD_TOKENS, DatasetWriter
from steadytrain.data.read.format import Manifest, compute_fingerprint
from steadytrain.errors import ConfigError, DatasetError
from steadytrain.storage.publish import canonical_digest

__all__ = ["TokenizeResult", "tokenize", "encode_stream", "default_workers"]

CHUNK_CHARS = 1 << 18  # ~256 KiB of text per task: amortises pickling, small tail
CHUNK_DOCS = 4096


@dataclasses.dataclass
class TokenizeResult:
    """What a tokenize run did."""

    url: str
    manifest: Manifest
    up_to_date: bool
    seconds: float
    input_files: int
    input_bytes: int
    empty_docs: int = 0
    replaced_files: int = 0
    replacements: int = 0
    warnings: list[str] = dataclasses.field(default_factory=list)
    skipped_files: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.manifest.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **result_json(self.url, self.manifest, self.up_to_date, self.seconds),
            "input_files": self.input_files,
            "input_bytes": self.input_bytes,
            "empty_docs": self.empty_docs,
            "replaced_files": self.replaced_files,
            "replacements": self.replacements,
            "skipped_files": self.skipped_files,
            "warnings": self.warnings,
        }


def _fingerprint_as(existing: Manifest, new: Manifest) -> str:
    """``new``'s fingerprint in the scheme ``existing`` was written with, so a dataset
    written before the fingerprint covered the document index still compares equal to the
    same content made now ("up to date"), not as a different dataset."""
    if existing.fingerprint_version == new.fingerprint_version:
        return new.fingerprint
    return compute_fingerprint(
        new.dtype,
        new.vocab_size,
        new.eos_id,
        list(new.shards),
        scheme=existing.fingerprint_version,
    )


def default_workers() -> int:
    return max(1, (os.cpu_count() or 1))


# -- parallel encoding -------------------------------------------------------------------
_WORKER_ENCODER: Encoder | None = None
TRIM_SLACK = 64 << 20  # heap growth tolerated above an encoder's start-up RSS


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _MemoryTrimmer:
    """Give freed heap memory back to the OS when an encoder's RSS drifts up (glibc only).

    Encoding leaves glibc's heap fragmented: left alone an encoder's RSS creeps up pass after
    pass over the data (measured: 62 -> 164 MB over four passes of a 12 MiB corpus; trimming
    after every chunk keeps it at 74 MB), so peak memory would depend on the corpus size.
    Trimming only when RSS exceeds the start-up RSS by ``TRIM_SLACK`` caps it at a fixed
    budget while keeping the cost (re-faulting released pages) rare.
    """

    def __init__(self) -> None:
        self._trim = None
        self._limit = 0
        try:
            import ctypes

            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            self._limit = _rss() + TRIM_SLACK
        except (OSError, AttributeError):
            pass  # not glibc: nothing to do

    def tick(self) -> None:
        if self._trim is not None and self._limit and _rss() > self._limit:
            self._trim(0)


_TRIMMER: _MemoryTrimmer | None = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _WORKER_ENCODER, _TRIMMER
    # One encoder thread per process: N workers use N cores, no oversubscription.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = Encoder(spec)
    _TRIMMER = _MemoryTrimmer()


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_ENCODER is not None and _TRIMMER is not None
    out = _WORKER_ENCODER.encode(texts)
    _TRIMMER.tick()
    return out


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in docs:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_stream(
    chunks: Iterator[list[str]], spec: TokenizerSpec, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode chunks of documents, yielding results in input order.

    ``workers == 0`` encodes in this process. Otherwise at most ``2 × workers`` chunks are in
    flight (a plain ``Pool.imap`` would drain the whole input into its task queue).
    """
    if workers <= 0:
        enc, trimmer = Encoder(spec), _MemoryTrimmer()
        for chunk in chunks:
            yield enc.encode(chunk)
            trimmer.tick()
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # forkserver: workers never inherit this process's threads (progress bar, tokenizers'
    # thread pool after BPE training), which fork would copy in an undefined state.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # The fork server imports this module once; workers fork from it with it loaded, so
        # starting W workers costs one import, not W.
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = mp.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(spec,))
    pending: deque = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise DatasetError(
            f"a tokenizer worker process died ({exc}); it was probably killed for memory: "
            f"rerun with fewer --workers"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- the command ---------------------------------------------------------------------------
def _recipe_key(
    sources: Sequence[SourceFile],
    tokenizer: str,
    spec_hash: str | None,
    shard_tokens: int,
    text_field: str,
    sample_bytes: int | None = None,
) -> str:
    """Identity of the inputs and settings: equal keys mean re-running would change nothing.

    ``sample_bytes`` (the ``train:VOCAB`` sample budget) is part of it only when a tokenizer
    is trained, so recipes of datasets that train none are the same as before it existed."""
    recipe: dict[str, Any] = {
        "tokenizer": tokenizer,
        "tokenizer_hash": spec_hash,
        "shard_tokens": shard_tokens,
        "text_field": text_field,
        "files": [[s.url, s.size, s.mtime] for s in sources],
    }
    if sample_bytes is not None:
        recipe["tokenizer_sample_bytes"] = sample_bytes
    return canonical_digest(recipe)


def tokenize(
    inputs: Sequence[str],
    out: str,
    *,
    tokenizer: str = "bytes",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    text_field: str = "text",
    progress: NullProgress | None = None,
    warn: Callable[[str], None] | None = None,
    include: Sequence[str] = (),
    tokenizer_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
) -> TokenizeResult:
    """Tokenize ``inputs`` into a new dataset at ``out`` (local path or fsspec URL).

    Directories are walked for known text suffixes plus the ``include`` globs; what a walk
    leaves out is reported through ``warn`` (and counted in ``skipped_files``).
    ``tokenizer="train:VOCAB"`` trains on a deterministic sample of at most
    ``tokenizer_sample_bytes`` bytes of text drawn from all inputs."""
    t0 = time.perf_counter()
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {workers}")
    progress = progress or NullProgress()
    warnings: list[str] = []

    def _warn(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    skipped = Skipped()
    sources = list_sources(inputs, include=include, skipped=skipped)
    total_bytes = sum(s.size for s in sources)
    if not sources or total_bytes == 0:
        hint = f"; {skipped.message()}" if skipped.count else ""
        raise DatasetError(
            f"the input is empty: {', '.join(inputs) or '(none)'} holds no readable bytes "
            f"({len(sources)} file(s)){hint}; nothing was written"
        )
    if skipped.count:
        _warn(skipped.message())
    resolved = resolve_tokenizer(tokenizer)
    fixed_hash = resolved.file_hash if isinstance(resolved, TokenizerSpec) else None
    sample_bytes = None
    if isinstance(resolved, int):
        check_sample_budget(tokenizer_sample_bytes)
        sample_bytes = tokenizer_sample_bytes
    recipe = _recipe_key(sources, tokenizer, fixed_hash, shard_tokens, text_field, sample_bytes)

    output = Output(out)
    if output.existing is not None and output.existing.extra.get("recipe") == recipe:
        return TokenizeResult(
            out,
            output.existing,
            True,
            time.perf_counter() - t0,
            len(sources),
            total_bytes,
            warnings=warnings,
            skipped_files=skipped.count,
        )
    if output.existing is not None and not output.store.is_local:
        # No rename on object stores: building next to it would mean overwriting it.
        raise output.different_dataset_error(None, "made from other inputs or settings")

    training: dict[str, int] | None = None
    if isinstance(resolved, int):
        assert sample_bytes is not None
        spec, training = train_on_sources(sources, resolved, text_field, sample_bytes, progress)
    else:
        spec = resolved
    if output.existing is not None:
        ex = output.existing
        if (ex.vocab_size, ex.eos_id, ex.dtype) != (spec.vocab_size, spec.eos_id, spec.dtype.name):
            raise output.different_dataset_error(
                None,
                f"its vocab_size/eos_id are {ex.vocab_size}/{ex.eos_id}, the new tokenizer's "
                f"{spec.vocab_size}/{spec.eos_id}",
            )

    stats = DecodeStats()
    store = output.begin()
    try:
        if spec.json_text is not None:
            store.write_bytes_atomic(TOKENIZER_FILE, spec.json_text.encode())
        writer = DatasetWriter(
            store,
            vocab_size=spec.vocab_size,
            eos_id=spec.eos_id,
            tokenizer=spec.manifest_entry(),
            shard_tokens=shard_tokens,
            extra={"recipe": recipe, "created_by": "steadytrain tokenize"},
        )
        if training is not None:
            writer.extra["tokenizer_training"] = training
        progress.start(total_bytes, "tokenize")
        docs = iter_documents(sources, text_field=text_field, stats=stats, warn=_warn)
        tokens = 0
        try:
            for ids, lengths in encode_stream(_chunks(docs), spec, workers):
                writer.add_documents(ids, lengths)
                tokens += ids.size
                progress.update(stats.bytes_read, tokens)
        except BaseException:
            writer.abort()
            raise
        finally:
            progress.stop()
        if stats.docs == 0:
            raise DatasetError(
                f"the input is empty: {', '.join(inputs)} holds no non-empty documents "
                f"({len(sources)} file(s), {stats.empty_docs} empty); nothing was written"
            )
        writer.extra["input"] = {
            "files": len(sources),
            "bytes": total_bytes,
            "empty_docs": stats.empty_docs,
            "replaced_files": stats.replaced_files,
            "replacements": stats.replacements,
        }
        manifest = writer.close()
        up_to_date = False
        if output.existing is not None:
            if output.existing.fingerprint != _fingerprint_as(output.existing, manifest):
                raise output.different_dataset_error(manifest.fingerprint, "different content")
            output.discard()  # same content already there: keep the old one untouched
            manifest, up_to_date = output.existing, True
        else:
            output.commit()
    except BaseException:
        output.discard()
        raise
    return TokenizeResult(
        out,
        manifest,
        up_to_date,
        time.perf_counter() - t0,
        len(sources),
        total_bytes,
        stats.empty_docs,
        stats.replaced_files,
        stats.replacements,
        warnings,
        skipped.count,
    )
