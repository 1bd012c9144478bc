"""Raw tensor records: how steadytrain's checkpoint writer stores a tensor in a ``.distcp`` file.

DCP's ``FileSystemWriter`` stores every tensor as a ``torch.save`` zip archive of its own:
a pickler built per call, ~36 small ``write()`` calls, ~0.25 ms of Python per tensor
(``bench/writer_profile.py``). A background writer holds the GIL for all of that, and the
training thread, which needs the GIL between every two kernel launches, waits: the
interference benchmark measured the default (thread-mode) writer slowing 13 ms steps by
+65 %, while writing the same bytes with no Python per tensor cost nothing measurable.

A raw record is a tensor's bytes exactly as a contiguous tensor holds them in memory (C
order, this host's byte order): one ``write()`` of a ``memoryview`` per tensor, with the
GIL released for the copy. What the bytes are is recorded in ``.metadata``, in the item's
``transform_descriptors`` (the field DCP keeps for stream transforms)::

    ["raw@steadytrain/1", "dtype=float32", "shape=4,32", "order=little"]

``reader.VerifyingReader`` (every steadytrain restore) reads raw records straight into the
destination tensors, and reads DCP's archives as before, so older checkpoints and
``tensor_format = "torch_save"`` ones load too. ``ShardReader`` here is DCP's
``FileSystemReader`` plus raw records and nothing else (no COMMIT, no checksums): what
``dcp.load(state, storage_reader=ShardReader(path))`` needs to read a checkpoint directory
outside steadytrain's restore. DCP's stock ``FileSystemReader`` does not know the
descriptor and refuses such a record (``ValueError: Unknown extension
name='raw@steadytrain'``) rather than misreading it.

Tensors a raw record cannot describe (quantized, sparse, nested, or a dtype without a
byte view) are written as DCP writes them, a ``torch.save`` archive; so are non-tensor
items, as DCP writes them (their bytes). A file may mix both: each record says what it is.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from steadytrain.checkpoint.archive import dest_bytes, narrow, pread_exact
from steadytrain.checkpoint.commit import safe_name
from steadytrain.checkpoint.regular import open_regular
from steadytrain.checkpoint.torch_private import storage_info, storage_infos
from steadytrain.errors import CheckpointError

__all__ = [
    "TAG",
    "TENSOR_FORMATS",
    "ShardReader",
    "descriptors",
    "meta_tensor",
    "raw_layout",
    "write_records",
]

TAG = "raw@steadytrain/1"
TENSOR_FORMATS = ("raw", "torch_save")


def _dtype(name: str) -> torch.dtype | None:
    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else None


def _raw_view(t: torch.Tensor) -> memoryview | None:
    """The bytes of CPU tensor ``t`` in C order (a copy only when ``t`` is not contiguous),
    or None when ``t`` has no plain byte view (then it goes as a ``torch.save`` archive)."""
    if type(t) is not torch.Tensor:  # a subclass (DTensor, FakeTensor): its own archive
        return None
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return None
    if _dtype(str(t.dtype).removeprefix("torch.")) is not t.dtype:
        return None
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    try:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    except (RuntimeError, TypeError, ValueError):
        return None


def descriptors(t: torch.Tensor) -> list[str]:
    """The ``transform_descriptors`` that describe ``t``'s raw record."""
    return [
        TAG,
        "dtype=" + str(t.dtype).removeprefix("torch."),
        "shape=" + ",".join(str(n) for n in t.shape),
        "order=" + sys.byteorder,
    ]


def meta_tensor(desc: Sequence[str] | None, where: str = "") -> torch.Tensor | None:
    """A ``meta`` tensor with the layout of the raw record ``desc`` describes (its bytes are
    C-ordered from the record's offset), or None when ``desc`` is no raw record's.
    CheckpointError when it is one but cannot be read here (damaged, another byte order)."""
    if not desc or desc[0] != TAG:
        if desc and desc[0].split("/", 1)[0] == TAG.split("/", 1)[0]:
            raise CheckpointError(
                f"{where}: record format {desc[0]!r} is newer than this steadytrain reads "
                f"({TAG}); upgrade steadytrain"
            )
        return None
    fields = dict(d.split("=", 1) for d in desc[1:] if "=" in d)
    dtype = _dtype(fields.get("dtype", ""))
    try:
        shape = [int(n) for n in fields["shape"].split(",") if n != ""]
    except (KeyError, ValueError):
        shape = None
    if dtype is None or shape is None or any(n < 0 for n in shape):
        raise CheckpointError(f"{where}: raw record descriptor {list(desc)} is damaged")
    if fields.get("order") != sys.byteorder:
        raise CheckpointError(
            f"{where}: a raw record in {fields.get('order')!r}-endian byte order; this host is "
            f"{sys.byteorder}-endian: load the checkpoint on a {fields.get('order')}-endian host"
        )
    return torch.empty(shape, dtype=dtype, device="meta")


def write_records(
    stream: Any,
    file_name: str,
    items: Sequence[Any],
    planner: Any,
    seen: list[tuple[Any, Any, memoryview | None]] | None = None,
) -> list[Any]:
    """Write ``items`` (a rank's ``WriteItem``s) into ``stream`` (a fresh binary file named
    ``file_name`` in the checkpoint), one record after another; DCP's ``WriteResult`` of
    each. Tensors go as raw records where they can (module docstring). ``seen``, when
    given, gets (item, the object written, its bytes or None for an archive) per record,
    in file order: what ``repeat_save`` learns the layout from."""
    results = []
    offset = 0
    for item in items:
        data = planner.resolve_data(item)
        desc: list[str] | None = None
        if item.type == WriteItemType.BYTE_IO:
            view = data.getbuffer()
        else:
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            view = _raw_view(t)
            if view is not None:
                desc = descriptors(t)
        if view is not None:
            stream.write(view)
            length = len(view)
        else:  # no byte view: DCP's own record, a torch.save archive
            torch.save(t, stream)
            length = stream.tell() - offset
        if seen is not None:
            seen.append((item, data, view))
        info = storage_info(file_name, offset, length, desc)
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        offset += length
    return results


def raw_layout(md: Any, where: str) -> tuple[torch.Tensor, int] | None:
    """(meta tensor, file offset of its bytes) of the raw record DCP's storage info ``md``
    describes, None for any other record; CheckpointError when the record's length and its
    descriptor disagree (a damaged ``.metadata``)."""
    meta = meta_tensor(md.transform_descriptors, where)
    if meta is None:
        return None
    nbytes = meta.numel() * meta.element_size()
    if nbytes != md.length:
        raise CheckpointError(
            f"{where}: a raw record of {md.length} bytes at offset {md.offset} is described "
            f"as {list(md.transform_descriptors)} ({nbytes} bytes): the checkpoint is damaged"
        )
    return meta, md.offset


def _is_raw(md: Any) -> bool:
    return bool(md.transform_descriptors) and md.transform_descriptors[0] == TAG


class ShardReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that also reads raw records: each is read into a fresh
    tensor of its dtype and shape, narrowed to what the plan asks (resharding) and copied
    into place, as DCP does with a ``torch.save`` archive. Everything else is DCP's."""

    def read_data(self, plan: Any, planner: Any) -> Future:
        infos = storage_infos(self) if plan.items else {}
        raw = [i for i in plan.items if _is_raw(infos[i.storage_index])]
        for item in raw:
            self._read_raw(item, infos[item.storage_index], planner)
        if len(raw) < len(plan.items):
            rest = [i for i in plan.items if not _is_raw(infos[i.storage_index])]
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_raw(self, item: Any, md: Any, planner: Any) -> None:
        where = os.path.join(str(self.path), safe_name(md.relative_path))
        layout = raw_layout(md, where)
        assert layout is not None  # _is_raw
        meta, at = layout
        with open(open_regular(where), "rb", buffering=0, closefd=True) as f:
            size = os.fstat(f.fileno()).st_size
            if at < 0 or md.length < 0 or at + md.length > size:  # before allocating it
                raise CheckpointError(
                    f"{where}: .metadata places a record at offset {at} with length "
                    f"{md.length}, outside this file's {size} bytes: .metadata is damaged"
                )
            record = torch.empty(meta.shape, dtype=meta.dtype)
            view = dest_bytes(record)
            if view is not None:  # None: no bytes to read (an empty tensor)
                pread_exact(f.fileno(), view, at, where)
        src = narrow(record, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != src.size():
            raise CheckpointError(
                f"{where}: {item.storage_index.fqn} is {tuple(src.size())} in the checkpoint, "
                f"{tuple(target.size())} in the state being restored"
            )
        target.copy_(src)
        planner.commit_tensor(item, target)
