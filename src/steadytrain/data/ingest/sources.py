"""Input readers for ``steadytrain tokenize``: JSON Lines, Parquet, plain text, directories.

Inputs are listed first (``list_sources``: a sorted, deterministic file list with sizes) and
read second (``iter_documents``: one string per document, in input order). Listing first lets
the caller check for an empty input before creating anything, size a progress bar, and key
an "up to date" check on the exact file list.

Decoding policy: text is decoded as UTF-8 with ``errors="replace"``. Invalid byte sequences
become U+FFFD, the run continues, and each affected file gets one warning naming it and the
number of replacements (real corpora, the Python standard library included, hold a few
non-UTF-8 files; failing a multi-hour run on one of them helps nobody, silently mangling
them is worse). Paths may be local or fsspec URLs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Sequence

import fsspec

from steadytrain.errors import DatasetError

__all__ = ["SourceFile", "DecodeStats", "list_sources", "iter_documents", "TEXT_SUFFIXES"]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst")
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


def _wanted_in_dir(rel: str) -> bool:
    parts = rel.split("/")
    if any(p.startswith(".") or p in SKIP_DIRS for p in parts):
        return False
    low = parts[-1].lower()
    return low.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES)


def _mtime(info: dict) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0.0)))
    try:
        return float(value)
    except (TypeError, ValueError):
        return float(value.timestamp()) if hasattr(value, "timestamp") else 0.0


def list_sources(inputs: Sequence[str]) -> list[SourceFile]:
    """Expand inputs into a deterministic list of files (directories walked, sorted)."""
    out: list[SourceFile] = []
    for inp in inputs:
        fs, root = fsspec.core.url_to_fs(inp)
        proto = inp.split("://", 1)[0] + "://" if "://" in inp else ""
        if not fs.exists(root):
            raise DatasetError(f"input {inp} does not exist; check the path")
        if fs.isdir(root):
            # find() returns every file below; sort by path so the order is the same on every
            # machine and every run (os.walk order is not).
            found = fs.find(root, detail=True, withdirs=False)
            prefix = root.rstrip("/") + "/"
            for path in sorted(found):
                rel = path[len(prefix) :] if path.startswith(prefix) else os.path.basename(path)
                if _wanted_in_dir(rel):
                    info = found[path]
                    url = path if not proto or proto == "file://" else proto + path
                    out.append(SourceFile(url, _kind(path), int(info["size"]), _mtime(info)))
        else:
            info = fs.info(root)
            url = inp if proto and proto != "file://" else root
            out.append(SourceFile(url, _kind(root), int(info["size"]), _mtime(info)))
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
    with fsspec.open(src.url, "rb") as f:
        data = f.read()
    stats.bytes_read += len(data)
    yield _decode(data, src.url, stats, warn)


def _iter_jsonl(
    src: SourceFile, text_field: str, stats: DecodeStats, warn: Warn | None
) -> Iterator[str]:
    bad_lines = 0
    with fsspec.open(src.url, "rb", compression="infer") as f:
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
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{src.url}:{lineno}: not valid JSON ({exc.msg})") from None
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
                    f"{type(text).__name__}, not a string"
                )
            yield text
    if bad_lines:
        stats.replaced_files += 1
        if warn is not None:
            warn(f"{src.url}: {bad_lines} line(s) not valid UTF-8; bad bytes replaced with U+FFFD")


def _iter_parquet(
    src: SourceFile, text_field: str, stats: DecodeStats, warn: Warn | None
) -> Iterator[str]:
    import pyarrow.parquet as pq

    with fsspec.open(src.url, "rb") as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise DatasetError(f"{src.url}: not a readable Parquet file ({exc})") from exc
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DatasetError(
                f"{src.url}: no column {text_field!r} (columns: {names}); pass --text-field NAME"
            )
        stats.bytes_read += src.size
        bad = 0
        # Row batches keep memory bounded by one batch, whatever the file size.
        for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, bytes):  # a binary column: decode like a text file
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        value = value.decode("utf-8", errors="replace")
                        bad += 1
                yield value or ""
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
