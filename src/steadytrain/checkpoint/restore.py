"""Restore the newest committed checkpoint that verifies; skip and report the others.

Rank 0 discovers candidates (only directories with a valid COMMIT) and broadcasts them. For
each candidate, newest first, every rank verifies the files it will read against COMMIT
(sizes and xxh3 checksums, before DCP unpickles ``.metadata``) and all ranks agree; then DCP
loads and reshards the tensors, and the JSON states and RNG are applied. A candidate that
fails anywhere is reported in ``skipped`` and the next older one is tried.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Any

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.checkpoint.writer import FAILURES as _FAILURES
from steadytrain.checkpoint.writer import Group
from steadytrain.errors import CheckpointError

__all__ = ["restore_latest"]


def _candidates(root: Root) -> tuple[list[dict], list[dict]]:
    cands, skipped = [], []
    for info in discover(root):
        if info.committed:
            cands.append({"name": info.name, "step": info.step, "manifest": info.manifest})
        else:
            why = info.error or "no COMMIT (partial: the save never finished)"
            skipped.append({"path": info.name, "step": info.step, "reason": why})
    return cands, skipped


def _local_copy(cand: dict, local: Root, remote: Root, rank: int, shards: bool) -> tuple[str, bool]:
    """A verified local directory with this remote checkpoint: the staging copy or a download."""
    here = os.path.join(local.root, cand["name"])
    try:
        C.verify_local(here, cand["manifest"], shards=shards)
        return here, False
    except CheckpointError:
        pass
    tmp = os.path.join(local.root, f".restore-{cand['name']}-rank{rank}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    remote.download(cand["name"], [f["path"] for f in cand["manifest"]["files"]], tmp)
    C.verify_local(tmp, cand["manifest"], shards=shards)
    return tmp, True


def _load(states: dict[str, Any], path: str, manifest: dict, group: Group) -> None:
    import torch.distributed.checkpoint as dcp

    template = S.dcp_state_dict(states)
    if template:
        dcp.load(
            template,
            storage_reader=dcp.FileSystemReader(path),
            process_group=group.pg,
            no_dist=not group.dist,
        )
        S.apply_dcp_state_dict(states, template)
    saved_world = int(manifest["world"]["world_size"])
    own = group.rank < saved_world
    with open(os.path.join(path, f"state-rank{(group.rank if own else 0):05d}.json")) as f:
        rank_json = json.load(f)
    S.apply_json_states(states, rank_json["states"])
    if own:
        S.set_rng_state(rank_json["rng"])
    else:  # a rank the saved job did not have: deterministic, distinct per rank
        S.seed_rng(S.derive_seed(int(manifest["step"]), group.rank))


def _verify_shards_async(path: str, manifest: dict, part: tuple[int, int]):
    """Checksum the shard files on a thread while DCP reads them (one pass over the disk)."""
    box: dict[str, BaseException] = {}

    def work() -> None:
        try:
            C.verify_local(path, manifest, part=part, shards=True, others=False)
        except _FAILURES as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=work, name="steadytrain-verify", daemon=True)
    t.start()
    return t, box


def restore_latest(
    states: dict[str, Any], group: Group, local: Root, remote: Root | None, verify: str = "full"
) -> dict[str, Any]:
    """Load the newest verified checkpoint into ``states``; returns the ``restore`` event.

    ``verify="full"``: every size and checksum is checked before anything is loaded.
    ``verify="overlap"`` (local directories): sizes, ``.metadata`` (the pickle) and the JSON
    files are checked first; the shard checksums are computed while DCP loads them, so the
    disk is read once. A shard that then fails its checksum makes the load fail: the next
    older checkpoint is loaded over it, and if none is left a CheckpointError says so (the
    live state was overwritten). Shards are read with torch's weights-only unpickler.
    """
    t0 = time.perf_counter()
    root = remote if remote is not None else local
    overlap = verify == "overlap" and remote is None
    part = (group.rank, group.world)  # ranks sharing a directory split the checksumming
    found = _candidates(root) if group.rank == 0 else None
    cands, skipped = group.broadcast(found)
    dirty = False  # live states hold data from a checkpoint that failed verification
    for cand in cands:
        path, err, tmp = "", None, False
        try:
            if remote is not None:
                path, tmp = _local_copy(cand, local, remote, group.rank, True)  # verified
            else:
                path = os.path.join(local.root, cand["name"])
                C.verify_local(path, cand["manifest"], part=part, shards=not overlap)
        except _FAILURES as exc:  # noqa: BLE001 - any failure means: try an older one
            err = f"rank {group.rank}: {exc}"
        errs = [e for e in group.all_gather(err) if e]
        if not errs:
            checker, box = (
                _verify_shards_async(path, cand["manifest"], part)
                if overlap
                else (
                    None,
                    {},
                )
            )
            try:
                _load(states, path, cand["manifest"], group)
            except _FAILURES as exc:  # noqa: BLE001
                err = f"rank {group.rank}: load failed: {type(exc).__name__}: {exc}"
            if checker is not None:
                checker.join()
                if "error" in box:
                    err, dirty = f"rank {group.rank}: {box['error']}", True
            errs = [e for e in group.all_gather(err) if e]
            dirty = dirty or bool(errs)
        if tmp:
            shutil.rmtree(path, ignore_errors=True)
        if not errs:
            return {
                "type": "restore",
                "step": cand["step"],
                "restore_s": time.perf_counter() - t0,
                "path": root.path(cand["name"]),
                "skipped": skipped,
                "tokens_seen": int(cand["manifest"].get("tokens_seen", 0)),
            }
        skipped.append({"path": cand["name"], "step": cand["step"], "reason": "; ".join(errs)})
    if dirty:
        raise CheckpointError(
            f"no checkpoint in {root.url} could be restored and a failed load already "
            f"overwrote part of the live state ({skipped[-1]['reason']}); restart the "
            "process (and remove the damaged checkpoints listed by `steadytrain checkpoints`)"
        )
    return {
        "type": "restore",
        "step": 0,
        "restore_s": time.perf_counter() - t0,
        "path": "",
        "skipped": skipped,
        "tokens_seen": 0,
    }
