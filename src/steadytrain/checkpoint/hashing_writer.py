"""The files one rank writes into a checkpoint, and their checksums taken on the way to disk.

COMMIT lists each file with its xxh3-64 checksum. Computing it after DCP had written and
fsync'd a shard meant reading every byte back from the page cache: at 128 MiB a rank that
was ~60 ms on this 2-core host, on the path between the last data byte and COMMIT, where the
hash of the same bytes while they are handed to ``write()`` (still in the CPU's caches, no
second read) costs ~15 ms. That is what this writer does: its file system wraps every stream
DCP opens and hashes what DCP writes through it, in order.

A digest is kept only when it provably describes the file: written front to back (a ``seek``
or a ``truncate`` voids it) and, once the stream is closed, the file on disk is exactly as
long as the bytes hashed. Anything else (and every file DCP writes in its daemon process, in
``process`` mode, where these digests would stay in the daemon) is hashed by reading it back,
as before: ``digests`` is a shortcut, never the authority.

The writer (``CheckpointWriter``, in every mode) writes tensors as raw records by default
(``raw_records.py``). Where it writes ``torch.save`` archives (``tensor_format =
"torch_save"``, or a tensor with no byte view) it skips the zip CRC-32 that
``torch.save`` computes for each tensor it archives: the largest single cost of a DCP
write after the fsync, checked by no reader. Only in the thread that writes, and only while
it writes: no other thread's ``torch.save`` loses its CRC.

``.metadata`` is written under a temporary name and renamed; the digest follows the rename.
The rank's own JSON file is hashed from the bytes in memory too (``write_rank_json``) and
fsync'd with ``fsync_files`` before COMMIT can list it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.futures import Future

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint.raw_records import TENSOR_FORMATS, write_records
from steadytrain.checkpoint.torch_private import (
    file_prefix,
    file_system_writer,
    zip_crc_off_in_this_thread,
)
from steadytrain.storage.publish import Hasher, digest_bytes

__all__ = [
    "CheckpointWriter",
    "HashingFileSystem",
    "hashing_writer",
    "rank_files",
    "rank_entries",
    "write_rank_json",
    "fsync_files",
]


class _HashingStream:
    """A binary stream that hashes every byte written through it, in order."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.hasher = Hasher()
        # Bound once: ``write`` runs thousands of times a save, on the writer thread, holding
        # the GIL the training thread needs; one Python frame per call, not three.
        self._update, self._write = self.hasher.update_unsized, raw.write
        self.size = 0
        self.sequential = True  # False once anything but appending happened

    def write(self, data: Any) -> int:
        self._update(data)
        n = self._write(data)  # a blocking binary stream writes it all and says how much
        self.size += n
        return n

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._raw.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.sequential = False
        return self._raw.truncate(*args)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> _HashingStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local ``FileSystem`` that records (size, xxh3-64 hex) of each file it writes,
    keyed by base name, in ``digests``."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode or "b" not in mode:  # reads, appends, text: nothing to record
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))
        with self._lock:
            self.digests.pop(name, None)
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        size = os.path.getsize(path)
        if stream.sequential and stream.size == size:
            with self._lock:
                self.digests[name] = (size, stream.hasher.digest_hex())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            known = self.digests.pop(os.path.basename(os.fspath(path)), None)
            if known is not None:
                self.digests[os.path.basename(os.fspath(new_path))] = known

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        with self._lock:
            self.digests.pop(os.path.basename(os.fspath(path)), None)


class CheckpointWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that writes each rank's tensors as raw records
    (``tensor_format="raw"``, ``raw_records.py``: no Python per tensor beyond one
    ``write()``), or as DCP's ``torch.save`` archives without torch's zip CRC-32
    (``"torch_save"``); also what DCP's checkpoint daemon runs in ``process`` mode.

    DCP stores each tensor as a ``torch.save`` archive, and torch computes a CRC-32 of every
    record at ~1 GB/s on a 2-core host: 60-140 ms of a 128 MiB shard, the largest cost
    between the last data byte and COMMIT after the fsync. Nothing reads it: ``torch.load``
    and ``dcp.load`` do not check it (a flipped byte loads silently) and ``archive.py`` reads
    members at their offsets; COMMIT's xxh3-64 of every whole file is what a restore
    verifies. The CRC is off only in the thread that runs this ``write_data`` (DCP writes in
    the calling thread with the default ``thread_count=1``), and only while it runs
    (``torch_private.zip_crc_off_in_this_thread``): a ``torch.save`` on any other thread
    during a checkpoint write keeps its CRC."""

    def __init__(self, path: str, *, tensor_format: str = "raw", **kwargs: Any) -> None:
        if tensor_format not in TENSOR_FORMATS:
            raise ValueError(f"tensor_format={tensor_format!r}: one of {TENSOR_FORMATS}")
        super().__init__(path, **kwargs)
        self.tensor_format = tensor_format
        # (item, object, bytes) of every record this rank wrote, in file order (raw format)
        self.written: list[tuple[Any, Any, memoryview | None]] = []
        self.planner: Any = None
        self.file_name = ""  # this rank's shard file (raw format)

    def storage_meta(self) -> Any:
        """None for raw checkpoints: DCP would put this save's path and a random save id into
        ``.metadata``, which would make two saves of one layout differ for no reader's benefit
        (every reader accepts None) and stop ``repeat_save`` from reusing the bytes."""
        return super().storage_meta() if self.tensor_format == "torch_save" else None

    def write_data(self, plan: Any, planner: Any) -> Any:
        with zip_crc_off_in_this_thread():  # archives that remain (torch_save, odd tensors)
            if self.tensor_format == "torch_save":
                return super().write_data(plan, planner)
            name = f"{file_prefix(plan)}0{DEFAULT_SUFFIX}"  # one file per rank, like DCP's
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
                self.written, self.planner, self.file_name = [], planner, name
                results = write_records(stream, name, plan.items, planner, self.written)
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut


def hashing_writer(path: str, **kwargs: Any) -> tuple[Any, HashingFileSystem]:
    """A ``CheckpointWriter`` for ``path`` (``kwargs`` are ``FileSystemWriter``'s) that
    hashes as it writes, and the file system whose ``digests`` it fills."""
    fs = HashingFileSystem()
    return file_system_writer(path, fs, cls=CheckpointWriter, **kwargs), fs


def rank_files(directory: str, rank: int) -> list[str]:
    """Names of the files ``rank`` wrote into a checkpoint directory."""
    mine = []
    for name in os.listdir(directory):
        if name.startswith(f"__{rank}_") or name == f"state-rank{rank:05d}.json":
            mine.append(name)
        elif rank == 0 and name == ".metadata":
            mine.append(name)
    return sorted(mine)


def write_rank_json(path: str, rank: int, doc: dict[str, Any]) -> tuple[str, tuple[int, str]]:
    """Write this rank's JSON states; its name and (size, xxh3-64), hashed from memory.
    fsync'd later by ``fsync_files``, after DCP's own fsyncs have flushed the journal."""
    name = f"state-rank{rank:05d}.json"
    data = json.dumps(doc).encode()
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)
    return name, (len(data), digest_bytes(data))


def fsync_files(path: str, names: list[str]) -> None:
    """Make files that were written without an fsync durable before COMMIT can name them."""
    for name in names:
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rank_entries(path: str, rank: int, known: dict[str, tuple[int, str]]) -> list[dict[str, Any]]:
    """COMMIT entries of the files ``rank`` wrote: from the digests taken while writing
    where there is one, else by reading the file back (``C.file_entry``)."""
    out = []
    for name in rank_files(path, rank):
        if name in known:
            size, digest = known[name]
            out.append({"path": name, "size": size, "xxh3_64": digest, "rank": rank})
        else:
            out.append(C.file_entry(path, name, rank))
    return out
