"""Repeat saves: write a checkpoint whose layout DCP planned last time without planning it again.

A background writer slows the training step by the Python it runs under the GIL, not by the
bytes it moves (``bench/interference.py``: writing a save's raw bytes from a thread costs a
13 ms step about 2 %, the same save through DCP several times that). Once tensors are raw
records (``raw_records.py``), most of what remains is DCP's per-save work: flattening the
state dict, building the local and global plans, looking up and describing each item, and
pickling ``.metadata``, all in Python, every save, for a layout that in a training run never
changes.

So the first save of a layout goes through ``dcp.save`` as always, and ``PlanCache.learn``
keeps what it wrote: for every record of this rank's shard file, in file order, the path of
its object in the staged state dict, its length and (for a tensor) its bytes; on rank 0 also
the ``.metadata`` bytes exactly as DCP wrote them. The next save of the same layout
(``Stager.layout_version`` unchanged) binds the new snapshot to those records
(``PlanCache.bind``: the Stager's buffers are the same tensors, so a tensor record costs an
identity check; a non-tensor value is compared with the last one and serialized again only
if it changed) and writes the file with ``os.writev``, hashing on the way, and rank 0 writes
the same ``.metadata`` bytes. The files are what ``dcp.save`` would write for that snapshot,
byte for byte (``tests/unit/test_checkpoint_repeat_save.py`` checks it): every record keeps
its offset and length, so the plan and the metadata are still true.

Anything that could make them untrue sends the save back to DCP, which plans it and is
learned again: a new layout version, a record whose length changed (a non-tensor value
that pickles to a different size), a record written as a ``torch.save`` archive, an object
that is not a plain tensor (a ``DTensor``: its placement is part of the plan), or any rank
that cannot bind (ranks agree with one all-gather, so all of them take the same path and
the metadata rank 0 reuses describes every rank's file).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from steadytrain.checkpoint.torch_private import zip_crc_off_in_this_thread
from steadytrain.storage.publish import Hasher, digest_bytes, publish_bytes

__all__ = ["PlanCache"]

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_METADATA = ".metadata"


@dataclass
class _Record:
    path: tuple  # the object's path in the staged (nested) state dict
    length: int
    tensor: torch.Tensor | None  # the Stager's buffer a tensor record was written from
    data: Any  # a tensor record's bytes (a view of ``tensor``); a value record's pickled bytes
    value: Any = None  # a value record's object, to tell whether it changed


def _plain_equal(a: Any, b: Any) -> bool:
    """``a == b`` for the plain values a state dict holds (numbers, strings, None, and lists,
    tuples and dicts of them), with a float's sign and NaNs told apart as pickle does; False
    for anything else, whose ``==`` we do not trust to mean "pickles the same"."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a.hex() == b.hex() or (math.isnan(a) and math.isnan(b))
    if a is None or isinstance(a, int | str | bytes):  # bool is an int
        return bool(a == b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_plain_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_plain_equal(a[k], b[k]) for k in a)
    return False


def _pickled(value: Any) -> bytes:
    """A non-tensor value as DCP stores it (``DefaultSavePlanner.transform_object``), and as
    ``CheckpointWriter`` has DCP store it: without the zip CRC-32 (``hashing_writer.py``)."""
    buf = io.BytesIO()
    with zip_crc_off_in_this_thread():
        torch.save(value, buf)
    return buf.getvalue()


def _lookup(staged: Any, path: tuple) -> Any:
    obj = staged
    for key in path:
        obj = obj[key]
    return obj


def _real_path(staged: Any, dcp_path: tuple, by_name: dict[int, dict[str, Any]]) -> tuple | None:
    """The path of DCP's flattened item ``dcp_path`` in ``staged`` as keys that index it:
    DCP names a dict's keys by their ``str()`` (an optimizer's parameter ids 0, 1, ... are
    "0", "1", ...). None when a name is missing or names two keys. ``by_name`` caches each
    dict's name-to-key table for the next item."""
    obj, real = staged, []
    for key in dcp_path:
        if isinstance(obj, dict) and key not in obj:
            table = by_name.get(id(obj))
            if table is None:
                table = {}
                for k in obj:
                    table[str(k)] = k if str(k) not in table else _AMBIGUOUS
                by_name[id(obj)] = table
            key = table.get(str(key), _AMBIGUOUS)
            if key is _AMBIGUOUS:
                return None
        obj = obj[key]
        real.append(key)
    return tuple(real)


_AMBIGUOUS = object()


def _write_records(file: str, chunks: list[Any]) -> tuple[int, str]:
    """Write ``chunks`` (buffers) to a new ``file`` in order with ``os.writev`` (the GIL
    released for each call), fsync it; its (size, xxh3-64), hashed from memory."""
    hasher = Hasher()
    for chunk in chunks:
        hasher.update_unsized(chunk)
    todo = [memoryview(c).cast("B") for c in chunks if len(c)]
    size = sum(len(c) for c in todo)
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        i = 0
        while i < len(todo):
            n = os.writev(fd, todo[i : i + _IOV_MAX])
            if n <= 0:
                raise OSError(f"{file}: writev wrote nothing")
            while n and i < len(todo):  # a short write: continue where it stopped
                if n >= len(todo[i]):
                    n -= len(todo[i])
                    i += 1
                else:
                    todo[i], n = todo[i][n:], 0
        os.fsync(fd)
        on_disk = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if on_disk != size:
        raise OSError(f"{file}: {on_disk} bytes on disk after writing {size}")
    return size, hasher.digest_hex()


class PlanCache:
    """One checkpointer's memory of its last DCP-planned save (module docstring)."""

    def __init__(self) -> None:
        self.version: int | None = None  # the Stager's layout_version the records are of
        self.file_name = ""
        self.records: list[_Record] = []
        self.metadata: bytes | None = None  # rank 0: .metadata as DCP wrote it

    def forget(self) -> None:
        self.version, self.records, self.metadata = None, [], None

    def learn(self, writer: Any, staged: Any, path: str, version: int, rank: int) -> None:
        """Keep what ``writer`` (the ``CheckpointWriter`` of a ``dcp.save`` of ``staged`` that
        just succeeded into ``path``) wrote, for layout ``version``; forget when some record
        cannot be repeated (module docstring)."""
        self.forget()
        mappings = getattr(writer.planner, "mappings", None)
        flat = getattr(writer.planner, "state_dict", None)
        if mappings is None or flat is None:  # not DCP's default (flattening) planner
            return
        records: list[_Record] = []
        by_name: dict[int, dict[str, Any]] = {}
        for item, obj, view in writer.written:
            dcp_path = mappings.get(item.index.fqn)
            if dcp_path is None or view is None:  # not flattened, or an archive record
                return
            path_of = _real_path(staged, dcp_path, by_name)
            if path_of is None:
                return
            if item.type == WriteItemType.BYTE_IO:  # obj is its pickle; keep the value too
                data = bytes(view)
                records.append(_Record(path_of, len(data), None, data, flat[item.index.fqn]))
                continue
            t = obj.detach() if isinstance(obj, torch.Tensor) else None
            if (
                t is None
                or _lookup(staged, path_of) is not obj  # a DTensor's shard, say
                or type(t) is not torch.Tensor
                or not t.is_contiguous()
                or t.is_conj()
                or t.is_neg()
                or any(item.index.offset or ())
            ):
                return  # its bytes are a copy, or a shard of something larger: plan each time
            records.append(_Record(path_of, len(view), obj, view))
        metadata = None
        if rank == 0:
            with open(os.path.join(path, _METADATA), "rb") as f:
                metadata = f.read()
        self.version, self.file_name, self.records = version, writer.file_name, records
        self.metadata = metadata

    def bind(self, staged: Any, version: int) -> list[Any] | None:
        """The bytes of every record of ``staged`` (a snapshot of layout ``version``) in file
        order, or None when this save must be planned again. Never raises."""
        if self.version is None or version != self.version:
            return None
        try:
            out: list[Any] = []
            for r in self.records:
                obj = _lookup(staged, r.path)
                if r.tensor is not None:
                    if obj is not r.tensor:  # the Stager gave a new buffer: plan again
                        return None
                    out.append(r.data)
                elif _plain_equal(obj, r.value):
                    out.append(r.data)
                else:
                    data = _pickled(obj)
                    if len(data) != r.length:
                        return None
                    r.value, r.data = obj, data  # a pair either way: the next save compares
                    out.append(data)
            return out
        except Exception:  # noqa: BLE001 - anything unexpected: DCP plans this save
            return None

    def write(self, path: str, chunks: list[Any], rank: int) -> dict[str, tuple[int, str]]:
        """Write this rank's shard file (and, on rank 0, ``.metadata``) into ``path``;
        (size, xxh3-64) per file name, as ``HashingFileSystem.digests`` has them."""
        # always, as DCP does: a rank whose items all went to other ranks has an empty file
        digests = {self.file_name: _write_records(os.path.join(path, self.file_name), chunks)}
        if rank == 0:
            assert self.metadata is not None
            publish_bytes(os.path.join(path, _METADATA), self.metadata)  # fsync'd, renamed
            digests[_METADATA] = (len(self.metadata), digest_bytes(self.metadata))
        return digests
