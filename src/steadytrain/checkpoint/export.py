"""Export a checkpoint to formats stock tools read: DCP without extensions, torch.save, safetensors.

A default checkpoint stores tensors as raw records (``raw_records.py``), which DCP's stock
``FileSystemReader`` refuses (``Unknown extension name='raw@steadytrain'``). ``export``
turns one checkpoint into:

- ``dcp``: a stock DCP directory. Shard files keep their names and their records' order;
  each raw record becomes the ``torch.save`` archive DCP itself writes for a tensor, every
  other record (archives, non-tensor values) is copied byte for byte, and ``.metadata``
  gets the new offsets and lengths (every chunk of a sharded tensor stays a chunk, so any
  world size loads it). The JSON states (loader, scheduler) and per-rank RNG, which live
  beside DCP in ``state-rankNNNNN.json``, are added as one non-tensor item ``_steadytrain``
  (``{"step", "tokens_seen", "world_size", "source", "ranks": [rank 0's document, ...]}``;
  a user's state name never starts with ``_``). Memory: one tensor record at a time.
- ``torch``: one ``torch.save`` file, what DCP's ``dcp_to_torch_save`` gives for that
  directory (it is made exactly so, from a temporary ``dcp`` export). Memory: the whole state.
- ``safetensors``: one module state as ``model.safetensors``, keyed by the module's own
  ``state_dict()`` keys (the checkpoint's ``<state>.`` prefix removed: for a Hugging Face
  model these are the names ``from_pretrained`` expects). Non-tensor entries cannot go into
  safetensors; they are listed in the result as ``skipped_keys``.

The checkpoint is verified first (COMMIT, every file's size and xxh3-64, every rank's JSON
state parsed as restore parses it): a damaged one is never exported. The destination is
built under a hidden temporary name beside it (``export_temp.py``: removed on failure,
SIGTERM and SIGINT, swept after a SIGKILL) and renamed into place; a destination that
exists, or appears meanwhile (an empty directory too), is never replaced.
"""

from __future__ import annotations

import os
import pickle
import time
import warnings
from collections.abc import Callable
from typing import Any

from steadytrain.checkpoint.commit import (
    COMMIT_NAME,
    MAX_COMMIT_BYTES,
    parse_commit,
    parse_dirname,
    verify_local,
)
from steadytrain.checkpoint.export_dcp import EXTRA_KEY
from steadytrain.checkpoint.regular import read_regular
from steadytrain.errors import CheckpointError

__all__ = ["FORMATS", "EXTRA_KEY", "export_checkpoint", "find_checkpoint"]

FORMATS = ("dcp", "torch", "safetensors")

Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes in all)


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


def _read_commit(path: str) -> dict[str, Any]:
    raw = read_regular(os.path.join(path, COMMIT_NAME), MAX_COMMIT_BYTES + 1)
    manifest = parse_commit(raw, path)
    parsed = parse_dirname(os.path.basename(os.path.normpath(path)))
    if parsed is not None and manifest["step"] != parsed[0]:
        raise CheckpointError(f"{path}: COMMIT says step {manifest['step']}; it is damaged")
    return manifest


def _verify(path: str, manifest: dict[str, Any], progress: Progress) -> None:
    """Every listed file's size and checksum, file by file (progress between files)."""
    files = manifest["files"]
    total, done = sum(int(f["size"]) for f in files), 0
    for f in files:
        verify_local(path, {"files": [f]}, checksums=True)
        done += int(f["size"])
        progress("verify", done, total)


def find_checkpoint(ckpt: str, progress: Progress = _no_progress) -> dict[str, Any]:
    """``{"path", "manifest", "skipped"}`` for CKPT: a checkpoint directory (verified), or a
    checkpoint root, meaning its newest committed checkpoint that verifies (newer ones that
    do not are listed in ``skipped`` with the reason). CheckpointError names what is wrong."""
    if "://" in ckpt and not ckpt.startswith("file://"):
        raise CheckpointError(
            f"{ckpt}: export reads a local checkpoint; copy it to a local disk first "
            "(it is verified against its COMMIT there)"
        )
    path = os.path.abspath(ckpt.removeprefix("file://"))
    if not os.path.isdir(path):
        raise CheckpointError(f"{ckpt}: no such directory; pass a checkpoint directory or root")
    if os.path.lexists(os.path.join(path, COMMIT_NAME)):
        manifest = _load_verified(path, progress)
        return {"path": path, "manifest": manifest, "skipped": []}
    if parse_dirname(os.path.basename(path)) is not None:
        raise CheckpointError(
            f"{path}: has no COMMIT: a partial checkpoint (its save never finished) is never "
            f"exported; export a committed one (steadytrain checkpoints {os.path.dirname(path)})"
        )
    from steadytrain.checkpoint.remote import Root, discover

    infos = discover(Root(path))
    if not infos:
        raise CheckpointError(
            f"{path}: neither a checkpoint (no COMMIT) nor a checkpoint root (no step-NNNNNNNN "
            "directories); pass a checkpoint directory or the root a Checkpointer writes to"
        )
    skipped = []
    for info in infos:
        where = os.path.join(path, info.name)
        if not info.committed:
            skipped.append({"path": where, "reason": info.error or "no COMMIT (partial)"})
            continue
        try:
            manifest = _load_verified(where, progress)
        except (CheckpointError, OSError) as exc:
            skipped.append({"path": where, "reason": str(exc)})
            continue
        return {"path": where, "manifest": manifest, "skipped": skipped}
    raise CheckpointError(
        f"{path}: no committed checkpoint verifies, nothing was exported: "
        + "; ".join(
            s["reason"] if s["reason"].startswith(s["path"]) else f"{s['path']}: {s['reason']}"
            for s in skipped
        )
    )


def _load_verified(path: str, progress: Progress) -> dict[str, Any]:
    from steadytrain.checkpoint.export_dcp import rank_states

    try:
        manifest = _read_commit(path)
        _verify(path, manifest, progress)
        rank_states(path, manifest)  # a state file restore would refuse: not this one either
    except CheckpointError as exc:
        raise CheckpointError(
            f"{path}: does not verify, nothing was exported ({exc}); export another "
            f"checkpoint (steadytrain checkpoints {os.path.dirname(path)} lists which verify)"
        ) from None
    return manifest


def _refuse_existing(out: str) -> None:
    if os.path.lexists(os.path.abspath(out)):
        raise CheckpointError(
            f"{out}: already exists; export never overwrites: pass a new --out path, or "
            "remove it first if it is an old export"
        )


def _check_dest(out: str, source: str) -> str:
    dest = os.path.abspath(out)
    _refuse_existing(out)
    src = os.path.realpath(source)
    if os.path.realpath(dest) == src or os.path.realpath(dest).startswith(src + os.sep):
        raise CheckpointError(f"{out}: inside the checkpoint {source}; export elsewhere")
    return dest


def export_checkpoint(
    ckpt: str,
    to: str,
    out: str,
    *,
    state: str | None = None,
    progress: Progress = _no_progress,
) -> dict[str, Any]:
    """Export CKPT (module docstring) as ``to`` (one of ``FORMATS``) to the new path ``out``.

    ``state``: for ``safetensors``, the module state to write (default ``model``, or the
    only module state). Returns ``{"source", "step", "to", "out", "bytes", "seconds",
    "tensors", "skipped", "skipped_keys"}``. CheckpointError (nothing written) when CKPT
    does not verify, ``out`` exists, or ``state`` names no module state.
    """
    if to not in FORMATS:
        raise CheckpointError(f"--to {to!r}: one of {', '.join(FORMATS)}")
    _refuse_existing(out)  # before any work: the cheapest refusals
    if to == "safetensors":
        from steadytrain.checkpoint.export_safetensors import need_safetensors

        need_safetensors()
    t0 = time.perf_counter()
    found = find_checkpoint(ckpt, progress)
    src, manifest = found["path"], found["manifest"]
    dest = _check_dest(out, src)
    metadata = _metadata(src, manifest)
    if to == "safetensors":
        from steadytrain.checkpoint.export_safetensors import pick_state

        state = pick_state(src, manifest, metadata, state)
    from steadytrain.checkpoint.export_temp import building, export_temp_name, sweep

    tmp = export_temp_name(dest)  # hidden, unique, beside DEST: the rename stays on one disk
    try:
        with building(tmp):  # removed on any error, SIGTERM and SIGINT too (export_temp.py)
            os.makedirs(os.path.dirname(dest), exist_ok=True)  # only now: a refusal writes nothing
            sweep(dest)  # what an export to DEST killed by SIGKILL left
            with warnings.catch_warnings():
                # One process reading a checkpoint is the intended use, not a mistake.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                tensors, skipped_keys = _write(
                    to, src, manifest, metadata, state, tmp, dest, progress
                )
    except FileExistsError:
        raise CheckpointError(
            f"{out}: appeared while exporting (someone else made it); it was left as it is "
            "and nothing was written: pass a new --out path"
        ) from None
    except OSError as exc:  # a full disk, a read-only --out, a file where a directory goes
        raise CheckpointError(
            f"export of {src} to {out} failed, nothing was written: {exc}; pass an --out "
            "on a writable disk with room for a copy of the checkpoint"
        ) from None
    return {
        "source": src,
        "step": manifest["step"],
        "to": to,
        "out": dest,
        "bytes": _size(dest),
        "seconds": round(time.perf_counter() - t0, 3),
        "tensors": tensors,
        "skipped": found["skipped"],
        "skipped_keys": skipped_keys,
    }


def _write(
    to: str,
    src: str,
    manifest: dict[str, Any],
    metadata: Any,
    state: str | None,
    tmp: str,
    dest: str,
    progress: Progress,
) -> tuple[int, list[str]]:
    """Build the export in ``tmp`` and publish it as ``dest``; (tensors, skipped keys).
    ``publish_new_dir``: a directory ``dest`` that appeared meanwhile is never replaced,
    even an empty one (``FileExistsError``)."""
    from steadytrain.storage.publish import publish_new_dir

    if to == "safetensors":
        from steadytrain.checkpoint.export_safetensors import write_safetensors

        tensors, skipped = write_safetensors(src, manifest, metadata, state, tmp, dest)
        if not dest.endswith(".safetensors"):
            publish_new_dir(tmp, dest)
        return tensors, skipped
    from steadytrain.checkpoint.export_dcp import write_dcp

    tensors = write_dcp(src, manifest, metadata, tmp, progress, durable=to == "dcp")
    if to == "torch":
        _write_torch(tmp, dest, progress)
    else:
        publish_new_dir(tmp, dest)
    return tensors, []


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _metadata(src: str, manifest: dict[str, Any]) -> Any:
    """DCP's ``Metadata``, unpickled from bytes checked against COMMIT (never re-read)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from steadytrain.checkpoint.reader import read_verified

    entries = {f["path"]: f for f in manifest["files"]}
    md = pickle.loads(read_verified(src, entries[".metadata"]))
    if not (
        isinstance(md, Metadata)
        and isinstance(md.state_dict_metadata, dict)
        and isinstance(md.planner_data, dict | None)
    ):
        raise CheckpointError(f"{src}/.metadata: not the DCP metadata a Checkpointer writes")
    return md


def publish_new_file(tmp_file: str, dest: str) -> None:
    """Give the finished ``tmp_file`` the name ``dest`` unless something has it (``link``
    fails on an existing name: nothing is ever replaced)."""
    from steadytrain.storage.publish import fsync_dir

    with open(tmp_file, "rb") as f:
        os.fsync(f.fileno())
    os.link(tmp_file, dest)  # FileExistsError: someone created it meanwhile
    os.unlink(tmp_file)
    fsync_dir(os.path.dirname(dest))


def _write_torch(dcp_dir: str, dest: str, progress: Progress) -> None:
    """``dcp_to_torch_save`` of the stock export ``dcp_dir`` into ``dest``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    total = _size(dcp_dir)
    progress("torch.save", 0, total)
    tmp_file = os.path.join(dcp_dir, "export.pt")
    dcp_to_torch_save(dcp_dir, tmp_file)
    publish_new_file(tmp_file, dest)
    progress("torch.save", total, total)
