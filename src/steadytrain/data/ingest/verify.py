"""``verify`` and ``inspect``: is a dataset sound, and what is in it.

``verify_dataset`` checks every invariant of format v1 (docs/format.md, part A):

- the manifest parses, has a known format and version, safe relative file names and a
  fingerprint that matches its shard list, and its totals agree with the shards;
- every listed file exists with exactly the listed size (bytes = tokens × itemsize for token
  files, docs × 8 for index files) and the listed xxh3-64 checksum;
- every document index is strictly increasing, starts above 0 and ends at the token count;
- every token id is below ``vocab_size``;
- a stored ``tokenizer.json`` matches the hash the manifest records.

Files are streamed in fixed-size chunks (local or remote alike), so memory stays flat
whatever the shard size. Files the manifest does not list are not an error. Problems are
collected, not raised, so one run reports every bad file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from steadytrain.data.ingest.progress import NullProgress
from steadytrain.data.ingest.tokenizer import stored_tokenizer_hash
from steadytrain.data.read.dataset import local_file_problem
from steadytrain.data.read.format import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    StreamingChecksum,
    read_manifest,
)
from steadytrain.errors import DatasetError, SteadyError
from steadytrain.storage.store import Store

__all__ = ["Problem", "VerifyReport", "verify_dataset", "dataset_info", "open_checked"]

CHUNK_BYTES = 8 << 20  # read 8 MiB at a time: flat memory, few calls


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


@dataclasses.dataclass
class VerifyReport:
    url: str
    problems: list[Problem]
    checked_files: int = 0
    checked_bytes: int = 0
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "dataset": self.url,
            "ok": self.ok,
            "problems": [dataclasses.asdict(p) for p in self.problems],
            "checked_files": self.checked_files,
            "checked_bytes": self.checked_bytes,
            "fingerprint": m.fingerprint if m else None,
            "fingerprint_version": m.fingerprint_version if m else None,
            "num_tokens": m.num_tokens if m else None,
            "num_shards": len(m.shards) if m else None,
        }


def _totals_problems(store: Store, manifest: Manifest, obj: dict) -> list[Problem]:
    """Top-level totals are informational copies; they must still agree with the shards."""
    out = []
    for key, actual in (
        ("num_tokens", manifest.num_tokens),
        ("num_docs", manifest.num_docs),
        ("num_shards", len(manifest.shards)),
    ):
        if key in obj and obj[key] != actual:
            out.append(
                Problem(
                    store.display(MANIFEST_NAME), f"{key} is {obj[key]}, shards add up to {actual}"
                )
            )
    return out


def _scan_file(store: Store, name: str, size: int, on_block: Callable[[bytes], None]) -> str:
    """Stream one file in fixed-size chunks, handing each to ``on_block``; its checksum.

    Local files are read sequentially; remote ones by ranged requests (each retried under
    the store's deadline), so memory stays at one chunk either way.
    """
    h = StreamingChecksum()
    if store.is_local:
        with store.open_read(name) as f:
            while block := f.read(CHUNK_BYTES):
                h.update(block)
                on_block(block)
        return h.hexdigest()
    for start in range(0, size, CHUNK_BYTES):
        block = store.read_bytes(name, start, min(start + CHUNK_BYTES, size))
        h.update(block)
        on_block(block)
    return h.hexdigest()


def _check_shard(
    store: Store, m: Manifest, shard: ShardInfo, report: VerifyReport, progress
) -> None:
    itemsize = m.itemsize
    dtype = np.dtype(m.dtype).newbyteorder("<")
    name_disp = store.display(shard.name)
    idx_disp = store.display(shard.index_name)
    if shard.bytes != shard.tokens * itemsize:
        report.problems.append(
            Problem(
                name_disp, f"manifest says {shard.bytes} bytes for {shard.tokens} {m.dtype} tokens"
            )
        )
    if shard.index_bytes != shard.docs * 8:
        report.problems.append(
            Problem(idx_disp, f"manifest says {shard.index_bytes} bytes for {shard.docs} documents")
        )
    for name, disp, expected in (
        (shard.name, name_disp, shard.bytes),
        (shard.index_name, idx_disp, shard.index_bytes),
    ):
        if not store.exists(name):
            report.problems.append(Problem(disp, "missing (listed in the manifest)"))
            return
        path = store.local_path(name)
        problem = local_file_problem(store.root, path) if path is not None else None
        if problem is not None:  # never read a FIFO (it blocks) or a file outside the root
            report.problems.append(Problem(disp, problem))
            return
        size = store.size(name)
        if size != expected:
            what = "truncated" if size < expected else "longer than listed"
            report.problems.append(
                Problem(disp, f"{what}: {size} bytes, the manifest says {expected}")
            )
            return

    # Token file: checksum and id range, chunk by chunk (never the whole shard in memory).
    max_id, first_bad, seen = -1, -1, 0
    carry = b""

    def on_tokens(block: bytes) -> None:
        nonlocal max_id, first_bad, seen, carry
        data = carry + block if carry else block
        usable = len(data) - len(data) % itemsize
        carry = data[usable:]
        if usable:
            arr = np.frombuffer(data, dtype=dtype, count=usable // itemsize)
            block_max = int(arr.max())
            if block_max >= m.vocab_size and first_bad < 0:
                first_bad = seen + int(np.argmax(arr >= m.vocab_size))
            max_id = max(max_id, block_max)
            seen += arr.size
        report.checked_bytes += len(block)
        progress.update(report.checked_bytes)

    checksum = _scan_file(store, shard.name, shard.bytes, on_tokens)
    report.checked_files += 1
    if checksum != shard.checksum:
        report.problems.append(
            Problem(
                name_disp,
                f"checksum {checksum} does not match the manifest's {shard.checksum}: the file is damaged",
            )
        )
    if max_id >= m.vocab_size:
        report.problems.append(
            Problem(
                name_disp,
                f"token id {max_id} is outside the vocabulary [0, {m.vocab_size}) (first bad id "
                f"at token {first_bad}); the data does not match its manifest: re-tokenize",
            )
        )

    # Index file: strictly increasing, first > 0, last == tokens.
    state = {"prev": 0, "first": True, "bad": None, "carry": b""}

    def on_index(block: bytes) -> None:
        data = state["carry"] + block if state["carry"] else block
        usable = len(data) - len(data) % 8
        state["carry"] = data[usable:]
        report.checked_bytes += len(block)
        progress.update(report.checked_bytes)
        if not usable or state["bad"] is not None:
            return
        ends = np.frombuffer(data, dtype="<u8", count=usable // 8)
        prev = np.empty(ends.size, dtype=np.uint64)
        prev[0] = state["prev"]
        prev[1:] = ends[:-1]
        bad = np.nonzero(ends <= prev)[0]
        if bad.size:
            state["bad"] = (
                f"document end offsets not strictly increasing ({int(prev[bad[0]])} then {int(ends[bad[0]])})"
            )
        state["prev"] = int(ends[-1])

    idx_sum = _scan_file(store, shard.index_name, shard.index_bytes, on_index)
    report.checked_files += 1
    if idx_sum != shard.index_checksum:
        report.problems.append(
            Problem(
                idx_disp,
                f"checksum {idx_sum} does not match the manifest's {shard.index_checksum}: the file is damaged",
            )
        )
    if state["bad"] is not None:
        report.problems.append(Problem(idx_disp, state["bad"]))
    elif shard.docs and state["prev"] != shard.tokens:
        report.problems.append(
            Problem(
                idx_disp,
                f"last document ends at {state['prev']}, the shard holds {shard.tokens} tokens",
            )
        )
    elif shard.tokens and not shard.docs:
        report.problems.append(Problem(idx_disp, f"no documents but {shard.tokens} tokens"))


def _problem(file: str, exc: Exception) -> Problem:
    """A problem from an error that may already name the file (printed once, not twice)."""
    msg = str(exc)
    return Problem(file, msg[len(file) + 2 :] if msg.startswith(f"{file}: ") else msg)


def verify_dataset(url: str, *, progress: NullProgress | None = None) -> VerifyReport:
    """Check every checksum and invariant; never raises for a bad dataset, reports it."""
    progress = progress or NullProgress()
    report = VerifyReport(url, [])
    try:
        store = Store(url)
        manifest = read_manifest(store)
    except SteadyError as exc:
        report.problems.append(_problem(f"{url.rstrip('/')}/{MANIFEST_NAME}", exc))
        return report
    report.manifest = manifest
    report.problems.extend(
        _totals_problems(store, manifest, json.loads(store.read_bytes(MANIFEST_NAME)))
    )
    total = sum(s.bytes + s.index_bytes for s in manifest.shards)
    progress.start(total, "verify")
    try:
        for shard in manifest.shards:
            try:
                _check_shard(store, manifest, shard, report, progress)
            except SteadyError as exc:
                report.problems.append(_problem(store.display(shard.name), exc))
            except OSError as exc:
                report.problems.append(Problem(store.display(shard.name), f"cannot read: {exc}"))
    finally:
        progress.stop()
    tok_file = manifest.tokenizer.get("file")
    if tok_file:
        disp = store.display(tok_file)
        try:
            data = store.read_bytes(tok_file)
            report.checked_files += 1
            if (
                manifest.tokenizer.get("hash")
                and stored_tokenizer_hash(data) != manifest.tokenizer["hash"]
            ):
                report.problems.append(
                    Problem(disp, "hash does not match the manifest's tokenizer.hash")
                )
        except SteadyError as exc:
            report.problems.append(_problem(disp, exc))
    return report


def open_checked(url: str) -> tuple[Store, Manifest]:
    """Read the manifest and check every listed file is present with its size (cheap)."""
    store = Store(url)
    manifest = read_manifest(store)
    for shard in manifest.shards:
        for name, expected in ((shard.name, shard.bytes), (shard.index_name, shard.index_bytes)):
            if not store.exists(name):
                raise DatasetError(
                    f"{store.display(name)} is missing (listed in the manifest); run `steadytrain verify {url}`"
                )
            path = store.local_path(name)
            problem = local_file_problem(store.root, path) if path is not None else None
            if problem is not None:
                raise DatasetError(
                    f"{store.display(name)} {problem}; run `steadytrain verify {url}`"
                )
            size = store.size(name)
            if size != expected:
                raise DatasetError(
                    f"{store.display(name)} has {size} bytes, the manifest says {expected}; "
                    f"run `steadytrain verify {url}`"
                )
    return store, manifest


def dataset_info(url: str) -> dict[str, Any]:
    """What ``inspect`` prints: the manifest's summary, after a cheap presence/size check."""
    store, m = open_checked(url)
    shard_tokens = [s.tokens for s in m.shards]
    data_bytes = sum(s.bytes + s.index_bytes for s in m.shards)
    return {
        "dataset": url,
        "format": "steadytrain.tokens",
        "version": 1,
        **m.summary(),
        "fingerprint_version": m.fingerprint_version,
        "tokenizer": m.tokenizer,
        "bytes": data_bytes,
        "mean_doc_tokens": round(m.num_tokens / m.num_docs, 2) if m.num_docs else 0.0,
        "min_shard_tokens": min(shard_tokens) if shard_tokens else 0,
        "max_shard_tokens": max(shard_tokens) if shard_tokens else 0,
        "extra": m.extra,
    }
