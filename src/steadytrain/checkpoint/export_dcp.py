"""``steadytrain export --to dcp``: rewrite a checkpoint's records so DCP's stock reader reads them.

Each shard file is copied record by record, in order, into a file of the same name: a raw
record (``raw_records.py``) becomes the ``torch.save`` archive DCP's ``FileSystemWriter``
writes for a tensor; any other record (DCP's own archives, non-tensor values) is copied
byte for byte with its descriptors. ``.metadata`` is DCP's own, with each record's new
offset and length and no raw descriptor; every chunk of a sharded tensor stays a chunk.
The JSON states and per-rank RNG (``state-rankNNNNN.json``) become one more non-tensor
item, ``_steadytrain``, in ``__steadytrain.distcp``. One tensor is in memory at a time.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Callable
from typing import Any

from steadytrain.checkpoint.commit import is_shard, safe_name
from steadytrain.checkpoint.regular import open_regular
from steadytrain.errors import CheckpointError

__all__ = ["EXTRA_KEY", "EXTRA_FILE", "write_dcp"]

EXTRA_KEY = "_steadytrain"  # the non-tensor item holding the JSON states and RNG
EXTRA_FILE = "__steadytrain.distcp"
_COPY = 8 << 20


def _json_states(src: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The ``_steadytrain`` item: the JSON states and RNG of every rank, plus step counts."""
    return {
        "step": manifest["step"],
        "tokens_seen": manifest["tokens_seen"],
        "world_size": manifest["world"]["world_size"],
        "source": src,
        "ranks": rank_states(src, manifest),
    }


def rank_states(src: str, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``state-rankNNNNN.json`` of the checkpoint, in rank order, read against COMMIT
    and parsed as restore parses them (``state.parse_rank_json``): CheckpointError names
    a file that restore would pass over, never a traceback."""
    from steadytrain.checkpoint.reader import read_verified
    from steadytrain.checkpoint.state import parse_rank_json

    return [
        parse_rank_json(read_verified(src, f), f"{src}/{f['path']}")
        for f in sorted(manifest["files"], key=lambda e: e["path"])
        if f["path"].startswith("state-rank") and f["path"].endswith(".json")
    ]


def write_dcp(
    src: str,
    manifest: dict[str, Any],
    metadata: Any,
    tmp: str,
    progress: Callable[[str, int, int], None],
    durable: bool = True,
) -> int:
    """Write the stock DCP form of the checkpoint into the new directory ``tmp``; the number
    of tensors it holds (module docstring). ``durable``: fsync every file (not for
    a temporary directory that only feeds ``--to torch``)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    from steadytrain.checkpoint.archive import dest_bytes, pread_exact
    from steadytrain.checkpoint.raw_records import raw_layout
    from steadytrain.checkpoint.torch_private import storage_info

    os.makedirs(tmp)
    entries = {f["path"]: f for f in manifest["files"]}
    per_file: dict[str, dict[tuple[int, int], list[Any]]] = {}
    infos = _storage_infos(src, metadata)
    for index, info in infos.items():
        records = per_file.setdefault(info.relative_path, {})
        records.setdefault((info.offset, info.length), []).append(index)
    shards = sorted({n for n in entries if is_shard(n)} | set(per_file))
    total = sum(int(entries[n]["size"]) for n in shards if n in entries)
    done, storage = 0, {}
    for rel in shards:
        if rel not in entries:
            raise CheckpointError(f"{src}: .metadata names {rel!r}, which COMMIT does not list")
        where = os.path.join(src, safe_name(rel))
        size = int(entries[rel]["size"])
        with (
            open(open_regular(where), "rb", buffering=0, closefd=True) as f,
            open(os.path.join(tmp, safe_name(rel)), "xb") as w,
        ):
            for (offset, length), indexes in sorted(per_file.get(rel, {}).items()):
                if offset < 0 or length < 0 or offset + length > size:
                    raise CheckpointError(
                        f"{where}: .metadata places a record at {offset}+{length}, outside the "
                        f"file's {size} bytes: .metadata is damaged"
                    )
                md = infos[indexes[0]]
                layout = raw_layout(md, where)
                start = w.tell()
                if layout is None:  # DCP's own record (an archive, a value): as it is
                    _copy(f.fileno(), w, offset, length, where)
                    desc = md.transform_descriptors
                else:
                    meta, at = layout
                    t = torch.empty(meta.shape, dtype=meta.dtype)
                    view = dest_bytes(t)
                    if view is not None:
                        pread_exact(f.fileno(), view, at, where)
                    torch.save(t, w)  # what DCP's FileSystemWriter writes for a tensor
                    desc = None
                new = storage_info(rel, start, w.tell() - start, desc)
                for index in indexes:
                    storage[index] = new
                done += length
                progress("export", done, total)
            _sync(w, durable)
    # The JSON states, as one non-tensor item in a file of its own.
    extra = io.BytesIO()
    try:
        torch.save(_json_states(src, manifest), extra)
    except RecursionError:  # parsed, but too deep for pickle (about half json's limit)
        raise CheckpointError(
            f"{src}: its JSON states (state-rank*.json) nest too deeply to be pickled into "
            "the export; export --to safetensors, which leaves them out"
        ) from None
    extra_name = EXTRA_FILE
    with open(os.path.join(tmp, extra_name), "xb") as w:
        w.write(extra.getvalue())
        _sync(w, durable)
    storage[MetadataIndex(EXTRA_KEY)] = storage_info(extra_name, 0, len(extra.getvalue()), None)
    planner_data = dict(metadata.planner_data or {})
    planner_data[EXTRA_KEY] = (EXTRA_KEY,)
    new_md = dataclasses.replace(
        metadata,
        state_dict_metadata={**metadata.state_dict_metadata, EXTRA_KEY: BytesStorageMetadata()},
        planner_data=planner_data,
        storage_data=storage,
    )
    with open(os.path.join(tmp, ".metadata"), "xb") as w:
        pickle.dump(new_md, w)
        _sync(w, durable)
    return sum(isinstance(v, TensorStorageMetadata) for v in metadata.state_dict_metadata.values())


def _storage_infos(src: str, metadata: Any) -> Any:
    """``{index: record}`` of every item, read through the fence around DCP's private
    ``_StorageInfo`` (``torch_private.storage_infos``), from the verified ``metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    from steadytrain.checkpoint.torch_private import storage_infos

    if not metadata.state_dict_metadata:  # nothing went through DCP: no records
        return {}
    reader = FileSystemReader(src)
    reader.set_up_storage_reader(metadata, is_coordinator=True)  # public: no file read
    return storage_infos(reader)


def _sync(w: Any, durable: bool) -> None:
    w.flush()
    if durable:
        os.fsync(w.fileno())


def _copy(fd: int, w: Any, offset: int, length: int, where: str) -> None:
    from steadytrain.checkpoint.archive import pread_exact

    buf = bytearray(min(length, _COPY))
    while length > 0:
        n = min(length, len(buf))
        view = memoryview(buf)[:n]
        pread_exact(fd, view, offset, where)
        w.write(view)
        offset, length = offset + n, length - n
