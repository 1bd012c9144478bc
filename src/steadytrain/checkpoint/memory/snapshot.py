"""One memory snapshot file: a rank's state at one step, checksummed, without pickle.

Layout (docs: ``memtier-spec.md``)::

    b"STMEM001" | u64 header length | header (JSON, utf-8) | u64 xxh64(header) | zero pad
    to a multiple of 64 | payload (tensor bytes back to back, each at a 64-byte offset)

The header holds the state tree with every tensor replaced by ``{"__tensor__": i}``, one
``{"dtype", "shape", "offset", "nbytes"}`` entry per tensor (offsets from the payload's
start), the JSON states, the RNG state, and the payload's length and xxh3-128. A reader
checks the magic, the header's own checksum, every tensor entry against the payload's
length and the payload's checksum before it trusts a byte (``parse``): a truncated, torn or
flipped file is a ``CheckpointError`` that names it.

The tree is what ``Stager`` staged from ``S.dcp_state_dict``: nested dicts, lists and
tuples; int/str keys (optimizer state dicts key parameters by int); ints, floats (nan and
inf too), bools, None, strings and tensors. JSON holds it exactly once tuples become
``{"__tuple__": [...]}`` and dicts whose keys are not all strings (or that could be
mistaken for a marker) become ``{"__dict__": [[key, value], ...]}``; decoding restores the
exact types. Nothing here ever unpickles.

A sharded tensor (a ``DTensor``: FSDP2, tensor parallel) keeps its local part, written as
``{"__dtensor__": [i, global shape, placements, mesh shape]}``. It decodes to a
``LocalShard``; ``place_shards`` turns it back into a ``DTensor`` on the live state's own
mesh and placements, and refuses one whose layout is not the live one (a restore then
falls back to durable checkpoints, which reshard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import struct
from typing import Any

import numpy as np
import torch
import xxhash

from steadytrain.checkpoint.memory.private import create_new, open_own
from steadytrain.errors import CheckpointError
from steadytrain.storage.publish import publish_file

__all__ = [
    "MAGIC",
    "FORMAT",
    "encode_tree",
    "decode_tree",
    "build",
    "layout",
    "fill",
    "Layout",
    "map_file",
    "map_fd",
    "anonymous",
    "parse",
    "read_header",
    "verify",
    "read_file",
    "write_file",
    "payload_digest",
    "LocalShard",
    "place_shards",
    "has_shards",
]

MAGIC = b"STMEM001"
# 2: the header carries ``run_nonce`` (the run that wrote it; run_identity.py). A format 1
# file cannot say which run wrote it, so it is never restored (the reader refuses it).
FORMAT = 2
ALIGN = 64
_U64 = struct.Struct("<Q")
_MARKERS = ("__tensor__", "__tuple__", "__dict__", "__dtensor__")
_MAX_HEADER = 1 << 30  # a header longer than this is damage, not a state tree
_DIGEST_LEN = 32  # hex digits of an xxh3-128


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# -- the tree -------------------------------------------------------------------------------
def encode_tree(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """``tree`` as a JSON value plus its tensors in order (``{"__tensor__": i}``)."""
    tensors: list[torch.Tensor] = []
    return _encode(tree, "<state>", tensors), tensors


def _encode(obj: Any, path: str, tensors: list[torch.Tensor]) -> Any:
    """One node of ``encode_tree`` (a module function, not a closure: a closure that calls
    itself holds itself, a reference cycle that kept every tensor of the last generation,
    1x the state, resident after ``close()`` until the garbage collector ran)."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):  # its local part, and the layout it must meet again
            layout = [
                list(obj.shape),
                [repr(p) for p in obj.placements],
                list(obj.device_mesh.shape),
            ]
            return {"__dtensor__": [_encode(obj.to_local(), path, tensors)["__tensor__"], *layout]}
        if obj.is_quantized or obj.layout != torch.strided:
            raise CheckpointError(
                f"state {path} is a {'quantized' if obj.is_quantized else 'sparse'} "
                "tensor: the memory tier keeps dense tensors only; set "
                "checkpoint.memory.every_steps = 0 and rely on durable checkpoints"
            )
        tensors.append(obj)
        return {"__tensor__": len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        plain = all(isinstance(k, str) for k in obj) and not (
            len(obj) == 1 and next(iter(obj)) in _MARKERS
        )
        if plain:
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        return {
            "__dict__": [
                [_encode(k, path, tensors), _encode(v, f"{path}[{k!r}]", tensors)]
                for k, v in obj.items()
            ]
        }
    raise CheckpointError(
        f"state {path} is a {type(obj).__name__}, which the memory tier cannot store "
        "without pickle (it keeps tensors, dicts, lists, tuples, numbers, strings, None); "
        "make that state's state_dict() return those, or set "
        "checkpoint.memory.every_steps = 0"
    )


def decode_tree(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of ``encode_tree``: the exact types back (tuples, int keys, tensors)."""
    if isinstance(obj, list):
        return [decode_tree(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            ((key, value),) = obj.items()
            if key == "__tensor__":
                return tensors[value]
            if key == "__tuple__":
                return tuple(decode_tree(v, tensors) for v in value)
            if key == "__dict__":
                return {_key(decode_tree(k, tensors)): decode_tree(v, tensors) for k, v in value}
            if key == "__dtensor__":
                i, shape, placements, mesh = value
                return LocalShard(
                    tensors[i], _ints(shape), tuple(map(str, placements)), _ints(mesh)
                )
        return {k: decode_tree(v, tensors) for k, v in obj.items()}
    return obj


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ValueError(f"{v!r} is not a list of ints")  # a header that is not ours
    return tuple(v)


@dataclasses.dataclass(frozen=True)
class LocalShard:
    """A ``DTensor``'s local part as a snapshot holds it, with the layout it was taken on."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]


def place_shards(tree: Any, live: Any, path: str = "<state>") -> Any:
    """``tree`` with every ``LocalShard`` a ``DTensor`` again, on the mesh and placements of
    the live state's tensor at the same place (no communication). A shard whose live
    counterpart is not a ``DTensor`` of the same global shape, placements, mesh shape and
    local shape is a ``CheckpointError``: the layout changed, and durable checkpoints
    (which reshard) must be used."""
    if isinstance(tree, LocalShard):
        from torch.distributed.tensor import DTensor

        now = (
            (
                tuple(live.shape),
                tuple(repr(p) for p in live.placements),
                tuple(live.device_mesh.shape),
                tuple(live.to_local().shape),
            )
            if isinstance(live, DTensor)
            else None
        )
        was = (tree.global_shape, tree.placements, tree.mesh_shape, tuple(tree.local.shape))
        if now != was:
            live_is = "is not sharded" if now is None else f"is {_placed(*now[:3])}"
            raise CheckpointError(
                f"state {path}: the snapshot holds a shard of {_placed(*was[:3])}, the live "
                f"state {live_is}: another layout, so durable checkpoints (which reshard) are "
                "used"
            )
        return DTensor.from_local(
            tree.local,
            live.device_mesh,
            live.placements,
            run_check=False,
            shape=live.shape,
            stride=live.stride(),
        )
    if isinstance(tree, dict):
        other = live if isinstance(live, dict) else {}
        return {k: place_shards(v, other.get(k), f"{path}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        same = isinstance(live, (list, tuple)) and len(live) == len(tree)
        parts = [
            place_shards(v, live[i] if same else None, f"{path}[{i}]") for i, v in enumerate(tree)
        ]
        return type(tree)(parts)
    return tree


def _placed(shape: tuple, placements: tuple, mesh: tuple) -> str:
    return f"{list(shape)} placed {list(placements)} on a mesh of {list(mesh)}"


def has_shards(tree: Any) -> bool:
    """Whether ``tree`` holds any ``LocalShard``."""
    if isinstance(tree, LocalShard):
        return True
    if isinstance(tree, dict):
        return any(has_shards(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(has_shards(v) for v in tree)
    return False


def _key(k: Any) -> Any:
    hash(k)  # a list key cannot come from encode_tree: the header was not ours
    return k


# -- the file image ---------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown tensor dtype {name!r}; the snapshot is damaged")
    return dtype


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    src = t.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous().reshape(-1)
    if src.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return src.view(torch.uint8).numpy()


def payload_digest(payload: Any) -> str:
    return xxhash.xxh3_128_hexdigest(payload)


class Layout:
    """Where everything of one file goes, known before a byte is copied (``layout``): the
    tier agrees on sizes and reserves the file before it fills it (``fill``)."""

    def __init__(self, header: dict[str, Any], tensors: list[torch.Tensor], start: int) -> None:
        self.header, self.tensors, self.start = header, tensors, start
        self.total = start + int(header["payload_nbytes"])


def layout(meta: dict[str, Any], tree: Any) -> Layout:
    """The layout of ``tree``'s file. ``meta`` holds the header's other fields (job, step,
    owner, world_size, node, tokens_seen, created, json_states, rng)."""
    encoded, tensors = encode_tree(tree)
    entries, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(
            {
                "dtype": _dtype_name(t.dtype),
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset = _align(offset + nbytes)
    header = {
        "format": FORMAT,
        **meta,
        "tree": encoded,
        "tensors": entries,
        "payload_nbytes": offset,
        "payload_xxh3_128": "0" * _DIGEST_LEN,  # the real digest has the same length
    }
    return Layout(header, tensors, _align(len(MAGIC) + 8 + len(_header_bytes(header)) + 8))


def fill(plan: Layout, image: np.ndarray) -> np.ndarray:
    """Write the file into ``image`` (``plan.total`` bytes: a buffer or a mapped file): one
    copy of every tensor, then the payload's checksum and the header."""
    if image.shape != (plan.total,):
        raise ValueError(f"an image of {plan.total} bytes cannot go into {image.shape}")
    header, start = dict(plan.header), plan.start
    payload = image[start:]
    for t, e in zip(plan.tensors, header["tensors"], strict=True):
        payload[e["offset"] : e["offset"] + e["nbytes"]] = _bytes_of(t)
        pad_end = _align(e["offset"] + e["nbytes"])
        payload[e["offset"] + e["nbytes"] : pad_end] = 0
    header["payload_xxh3_128"] = payload_digest(payload)
    raw = _header_bytes(header)
    pos = 0
    for piece in (MAGIC, _U64.pack(len(raw)), raw, _U64.pack(xxhash.xxh64_intdigest(raw))):
        image[pos : pos + len(piece)] = np.frombuffer(piece, np.uint8)
        pos += len(piece)
    image[pos:start] = 0
    return image


def build(meta: dict[str, Any], tree: Any, out: np.ndarray | None = None) -> np.ndarray:
    """The whole file as one uint8 array (``out`` is reused when it has the right size)."""
    plan = layout(meta, tree)
    reuse = out is not None and out.shape == (plan.total,)
    return fill(plan, out if reuse else np.empty(plan.total, np.uint8))


def _header_bytes(header: dict[str, Any]) -> bytes:
    return json.dumps(header, allow_nan=True, separators=(",", ":")).encode()


def _parse_header(buf: memoryview, size: int, where: str) -> tuple[dict[str, Any], int]:
    """The verified header and the payload's start; ``size``: the file's length."""
    if size < len(MAGIC) + 16 or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise CheckpointError(
            f"{where}: not a steadytrain memory snapshot (bad magic or too short, "
            f"{size} bytes); remove it"
        )
    (hlen,) = _U64.unpack_from(buf, len(MAGIC))
    end = len(MAGIC) + 8 + hlen
    if hlen > _MAX_HEADER or end + 8 > size:
        raise CheckpointError(
            f"{where}: truncated (header of {hlen} bytes, file of {size}); the snapshot is torn"
        )
    raw = bytes(buf[len(MAGIC) + 8 : end])
    if xxhash.xxh64_intdigest(raw) != _U64.unpack_from(buf, end)[0]:
        raise CheckpointError(f"{where}: header checksum mismatch; the snapshot is damaged")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: header is not JSON ({exc}); damaged") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else None
        why = " (written before snapshots named their run)" if got == 1 else ""
        raise CheckpointError(
            f"{where}: snapshot format {got!r}{why}, this steadytrain reads format {FORMAT}"
        )
    start = _align(end + 8)
    need = header.get("payload_nbytes")
    if not isinstance(need, int) or need < 0 or start + need != size:
        raise CheckpointError(
            f"{where}: truncated or padded (payload of {size - start} bytes, header says "
            f"{need}); the snapshot is torn"
        )
    return header, start


def read_header(path: str) -> dict[str, Any]:
    """The verified header of a snapshot file (the payload is not read); only this user's
    own regular file is opened (``private.open_own``)."""
    fd = open_own(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    with open(fd, "rb") as f:
        head = f.read(min(size, len(MAGIC) + 8))
        if len(head) == len(MAGIC) + 8:
            (hlen,) = _U64.unpack_from(head, len(MAGIC))
            head += f.read(min(hlen, _MAX_HEADER) + 8)
    header, _ = _parse_header(memoryview(head), size, path)
    return header


def verify(buf: np.ndarray, where: str) -> dict[str, Any]:
    """Check a whole file image (magic, header checksum, length, payload checksum); returns
    its header. Nothing is decoded."""
    header, start = _parse_header(memoryview(buf), len(buf), where)
    if payload_digest(buf[start:]) != header.get("payload_xxh3_128"):
        raise CheckpointError(f"{where}: payload checksum mismatch; the snapshot is damaged")
    return header


def parse(buf: np.ndarray, where: str) -> tuple[dict[str, Any], Any]:
    """Verify a whole file image and decode it: (header, tree). The tree's tensors are
    views of ``buf`` (no copy): keep ``buf`` unmodified while they are in use."""
    header = verify(buf, where)
    payload = buf[len(buf) - header["payload_nbytes"] :]
    tensors = []
    try:
        for e in header["tensors"]:
            off, nbytes, shape = int(e["offset"]), int(e["nbytes"]), [int(s) for s in e["shape"]]
            dtype = _dtype(e["dtype"], where)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if off % ALIGN or off < 0 or off + nbytes > len(payload) or min(shape, default=0) < 0:
                raise ValueError(f"tensor at {off} of {nbytes} bytes lies outside the payload")
            if nbytes != math.prod(shape) * itemsize:
                raise ValueError(f"tensor of shape {shape} cannot hold {nbytes} bytes")
            flat = torch.from_numpy(payload[off : off + nbytes])
            tensors.append(flat.view(dtype).reshape(shape))
        tree = decode_tree(header["tree"], tensors)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a checksummed header that does not decode
        raise CheckpointError(f"{where}: malformed header ({type(exc).__name__}: {exc})") from None
    return header, tree


def read_file(path: str, out: np.ndarray | None = None) -> np.ndarray:
    """The whole file into a writable buffer (``out`` reused when it has the right size)."""
    fd = open_own(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    buf = out if out is not None and out.shape == (size,) else np.empty(size, np.uint8)
    with open(fd, "rb", buffering=0) as f:
        got = f.readinto(memoryview(buf)) if size else 0
    if got != size:
        raise CheckpointError(f"{path}: read {got} of {size} bytes (changed while read)")
    return buf


def map_fd(fd: int, size: int, shared: bool) -> np.ndarray:
    """``size`` bytes of an open file as a writable array. ``shared``: writes go to the
    file, and its pages are mapped at once (``MAP_POPULATE``: one pass instead of a fault
    per written page); otherwise copy-on-write, nothing done to the array reaches the file,
    and pages are mapped as they are read (populating a private writable mapping would
    copy every page)."""
    if size == 0:
        return np.empty(0, np.uint8)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0) if shared else mmap.MAP_PRIVATE
    mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mapping, dtype=np.uint8)  # the array keeps the mapping alive


def map_file(path: str, readonly: bool = False) -> np.ndarray:
    """The whole file, mapped instead of read: a tmpfs file's pages are used in place (no
    copy). Copy-on-write, so nothing done to the array reaches the file; ``readonly``: a
    read-only array whose pages are all mapped at once (``MAP_POPULATE``: a copy sent to a
    peer is read whole, and a fault per page cost more than the transfer). The tier never
    shrinks a file while it may be mapped (``Store.reserve`` recycles only older
    generations, never the one a restore or a send is reading). Only this user's own regular
    file is opened (``private.open_own``)."""
    fd = open_own(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not readonly or size == 0:
            return map_fd(fd, size, shared=False)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ), np.uint8)
    finally:
        os.close(fd)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap does not name it


def anonymous(size: int) -> np.ndarray:
    """``size`` bytes of fresh memory, every page mapped before it is used: a copy
    received from a peer fills all of it, and a fault per page while receiving made that
    transfer slow and erratic (BENCHMARKS.md, "Memory tier"). Huge pages where the kernel
    allows them (a 2 MiB fault maps what 512 small ones would; 4x faster to provision
    130 MB here), populated in one call, or by touching a byte per page on older kernels."""
    if size == 0:
        return np.empty(0, np.uint8)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(mapping, np.uint8)  # the array keeps the mapping alive
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        array[:: mmap.PAGESIZE] = 0
    return array


def write_file(path: str, image: np.ndarray) -> None:
    """Write ``path`` whole or not at all: ``NAME.tmp-<pid>`` (a new file: a name that
    exists is an error, never written through), then published by the one atomic-publish
    module (``storage/publish.py``). No fsync: the directory is RAM (tmpfs), which a power
    loss empties anyway."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = create_new(tmp)
    try:
        with open(fd, "wb", buffering=0) as f:
            view, done = memoryview(image), 0
            while done < len(view):
                done += f.write(view[done:])
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a full tmpfs: the partial file would hold the space
        raise
    publish_file(tmp, path, durable=False)
