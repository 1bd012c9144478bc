"""Input readers for ``steadytrain tokenize``: JSON Lines, Parquet, plain text, directories.

Inputs are listed first (``list_sources``: a sorted, deterministic file list with sizes) and
read second (``iter_documents``: one string per document, in input order). Listing first lets
the caller check for an empty input before creating anything, size a progress bar, and key
an "up to date" check on the exact file list.

Decoding policy: text is decoded as UTF-8 with ``errors="replace"``. Invalid byte sequences
become U+FFFD, the run continues, and each affected file gets one warning naming it and the
number of replacements (real corpora, the Python standard library included, hold a few
non-UTF-8 files; failing a multi-hour run on one of them helps nobody, silently mangling
them is worse). Paths may be local or fsspec URLs; bytes are reached through
``steadytrain.storage.files``.

Walking a directory reads files with a known suffix (``TEXT_SUFFIXES``, JSON Lines,
Parquet) plus any matching an ``include`` glob. Nothing is skipped silently: files left out
for an unknown suffix are counted, and the caller warns with examples and the
``--include GLOB`` fix.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import lzma
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from steadytrain.errors import DatasetError
from steadytrain.extras import require
from steadytrain.storage.files import list_input, open_input

__all__ = [
    "SourceFile",
    "DecodeStats",
    "Skipped",
    "list_sources",
    "iter_documents",
    "TEXT_SUFFIXES",
]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
PARQUET_SUFFIXES = (".parquet",)
# Files picked up when walking a directory (an explicitly named file is read whatever its
# suffix). Compiled or binary files (.pyc, images) are never documents.
TEXT_SUFFIXES = (
    ".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go",
    ".java", ".js", ".ts", ".sh", ".tex", ".html", ".css", ".toml", ".yaml", ".yml", ".cfg",
    ".ini", ".xml", ".csv", ".tsv",
)  # fmt: skip
SKIP_DIRS = ("__pycache__", ".git", ".hg", ".svn")

Warn = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One input file: where it is, how to read it, and its size and mtime (for staleness)."""

    url: str
    kind: str  # "jsonl" | "parquet" | "text"
    size: int
    mtime: float


@dataclasses.dataclass
class DecodeStats:
    """What reading found: documents, skipped empty ones, and decode replacements."""

    docs: int = 0
    empty_docs: int = 0
    bytes_read: int = 0
    replaced_files: int = 0
    replacements: int = 0


def _kind(name: str) -> str:
    low = name.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _hidden(rel: str) -> bool:
    return any(p.startswith(".") or p in SKIP_DIRS for p in rel.split("/"))


def _included(rel: str, include: Sequence[str]) -> bool:
    """A known suffix, or a match of any ``include`` glob (on the relative path or the name)."""
    low = rel.rsplit("/", 1)[-1].lower()
    if low.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES):
        return True
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(name, g) for g in include)


@dataclasses.dataclass
class Skipped:
    """Files a directory walk left out because no suffix or ``--include`` glob matched."""

    count: int = 0
    bytes: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)

    def add(self, url: str, size: int) -> None:
        self.count += 1
        self.bytes += size
        if len(self.examples) < 5:
            self.examples.append(url)

    def message(self) -> str:
        return (
            f"skipped {self.count} file(s) ({self.bytes:,} bytes) with no known text suffix, "
            f"e.g. {', '.join(self.examples)}; pass --include GLOB (e.g. --include 'LICENSE*' "
            f"or --include '*') to tokenize them too"
        )


def list_sources(
    inputs: Sequence[str], *, include: Sequence[str] = (), skipped: Skipped | None = None
) -> list[SourceFile]:
    """Expand inputs into a deterministic list of files (directories walked, sorted).

    Hidden files and ``__pycache__``-like directories are never read; other files a walk
    leaves out are counted in ``skipped``. An explicitly named file is read whatever its
    suffix.
    """
    out: list[SourceFile] = []
    for inp in inputs:
        is_dir, files = list_input(inp)
        for f in files:
            if is_dir and _hidden(f.rel):
                continue
            if is_dir and not _included(f.rel, include):
                if skipped is not None:
                    skipped.add(f.url, f.size)
                continue
            out.append(SourceFile(f.url, _kind(f.rel or f.url), f.size, f.mtime))
    return out


def _decode(data: bytes, src: str, stats: DecodeStats, warn: Warn | None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        text = data.decode("utf-8", errors="replace")
        # Replacement characters the decoder added (ones already in the input don't count).
        n = text.count("\ufffd") - data.count("\ufffd".encode())
        stats.replaced_files += 1
        stats.replacements += n
        if warn is not None:
            warn(
                f"{src}: not valid UTF-8 (first bad byte at offset {exc.start}); "
                f"{n} invalid byte sequence(s) replaced with U+FFFD"
            )
        return text


def _iter_text(src: SourceFile, stats: DecodeStats, warn: Warn | None) -> Iterator[str]:
    with open_input(src.url) as f:
        data = f.read()
    stats.bytes_read += len(data)
    yield _decode(data, src.url, stats, warn)


def _iter_jsonl(
    src: SourceFile, text_field: str, stats: DecodeStats, warn: Warn | None
) -> Iterator[str]:
    try:
        yield from _jsonl_lines(src, text_field, stats, warn)
    except (EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
        # gzip raises EOFError for a truncated stream and BadGzipFile (an OSError) or
        # zlib.error for damaged bytes; bz2 an OSError, xz LZMAError.
        raise DatasetError(
            f"{src.url}: truncated or damaged compressed file ({type(exc).__name__}: {exc}); "
            f"the file is incomplete: copy or re-compress it again (`gzip -t FILE` checks a "
            f".gz), or leave it out"
        ) from None


def _jsonl_lines(
    src: SourceFile, text_field: str, stats: DecodeStats, warn: Warn | None
) -> Iterator[str]:
    bad_lines = 0
    with open_input(src.url, compression="infer") as f:
        for lineno, raw in enumerate(f, 1):
            stats.bytes_read += len(raw)
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", errors="replace")
                bad_lines += 1
                stats.replacements += line.count("\ufffd") - raw.count("\ufffd".encode())
            try:
                obj = json.loads(line)
            except RecursionError:
                raise DatasetError(
                    f"{src.url}:{lineno}: a JSON value nested too deeply to be a document; "
                    f"fix or remove that line"
                ) from None
            except ValueError as exc:  # JSONDecodeError, or an integer of 4300+ digits
                msg = getattr(exc, "msg", str(exc))
                raise DatasetError(f"{src.url}:{lineno}: not valid JSON ({msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DatasetError(
                    f"{src.url}:{lineno}: no field {text_field!r} (found {keys}); "
                    f"pass --text-field NAME"
                )
            text = obj[text_field]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise DatasetError(
                    f"{src.url}:{lineno}: field {text_field!r} is a "
                    f"{type(text).__name__}, not a string; pass --text-field NAME of a text "
                    f"field, or fix that line"
                )
            yield text
    if bad_lines:
        stats.replaced_files += 1
        if warn is not None:
            warn(f"{src.url}: {bad_lines} line(s) not valid UTF-8; bad bytes replaced with U+FFFD")


def _text_type(pa: Any, typ: Any) -> bool:
    """Does a Parquet column of this Arrow type hold text (strings or bytes, possibly
    dictionary-encoded, or only nulls)?"""
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    checks = ("is_string", "is_large_string", "is_binary", "is_large_binary", "is_null")
    checks += ("is_string_view", "is_binary_view")
    return any(getattr(pa.types, c, lambda _t: False)(typ) for c in checks)


def _iter_parquet(
    src: SourceFile, text_field: str, stats: DecodeStats, warn: Warn | None
) -> Iterator[str]:
    pq = require("pyarrow.parquet", f"reading the Parquet file {src.url}")
    import pyarrow as pa

    with open_input(src.url) as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise DatasetError(f"{src.url}: not a readable Parquet file ({exc})") from exc
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DatasetError(
                f"{src.url}: no column {text_field!r} (columns: {names}); pass --text-field NAME"
            )
        typ = pf.schema_arrow.field(text_field).type
        if not _text_type(pa, typ):
            # An int, list or struct column would reach the tokenizer as a non-string.
            raise DatasetError(
                f"{src.url}: column {text_field!r} holds {typ}, not text (string or binary); "
                f"pass --text-field NAME of a text column, or convert the column to strings"
            )
        stats.bytes_read += src.size
        bad = 0
        # Row batches keep memory bounded by one batch, whatever the file size.
        try:
            batches = pf.iter_batches(batch_size=1024, columns=[text_field])
            for batch in batches:
                for value in batch.column(0).to_pylist():
                    if isinstance(value, bytes):  # a binary column: decode like a text file
                        try:
                            value = value.decode("utf-8")
                        except UnicodeDecodeError:
                            text = value.decode("utf-8", errors="replace")
                            bad += 1
                            # Replacement characters the decoder added, as for text files.
                            n = text.count("\ufffd") - value.count("\ufffd".encode())
                            stats.replacements += n
                            value = text
                    yield value or ""
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(
                f"{src.url}: column {text_field!r} cannot be read ({exc}); the Parquet file is "
                f"damaged: re-export it, or leave it out"
            ) from None
        if bad:
            stats.replaced_files += 1
            if warn is not None:
                warn(f"{src.url}: {bad} value(s) not valid UTF-8; bad bytes replaced with U+FFFD")


def iter_documents(
    sources: Sequence[SourceFile],
    *,
    text_field: str = "text",
    stats: DecodeStats | None = None,
    warn: Warn | None = None,
) -> Iterator[str]:
    """Yield every non-empty document, in order; empty ones are counted and skipped."""
    stats = stats if stats is not None else DecodeStats()
    for src in sources:
        if src.kind == "jsonl":
            docs = _iter_jsonl(src, text_field, stats, warn)
        elif src.kind == "parquet":
            docs = _iter_parquet(src, text_field, stats, warn)
        else:
            docs = _iter_text(src, stats, warn)
        for text in docs:
            if text:
                stats.docs += 1
                yield text
            else:
                stats.empty_docs += 1
