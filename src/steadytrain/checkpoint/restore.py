"""Restore the newest committed checkpoint that verifies; skip and report the others.

Rank 0 discovers candidates (only directories with a valid COMMIT) and broadcasts them. For
each candidate, newest first: every rank checks names and sizes of every file and reads
``.metadata`` and its JSON state once, checksummed (``_preverify``); each JSON state is checked
against its object without loading it (the loader's ``check_state_dict``), and all ranks
agree; then DCP loads and reshards the tensors through ``reader.VerifyingReader``, which
(``verify="full"``) checksums every shard file before any live tensor is written and then
copies tensor bytes straight into place; the JSON states and RNG are applied last.

A candidate that fails verification (or misses a file its COMMIT lists) is reported in
``skipped`` and the next older one is tried. One that verifies but does not fit the job
(another seq_len, a missing state, other tensor shapes) stops the restore with a
``CheckpointError`` that says the checkpoint is intact: falling back would silently drop
progress, or, with nothing older, silently start from scratch beside good checkpoints. So
does one that cannot be read at all (a full local disk for its download, a dead store, no
read permission): it is not known to be damaged, and the error names the cause. Advice to
remove checkpoints is given only for ones that failed verification.

A checkpoint of another run is passed over too (``foreign_run``): its COMMIT's ``run_nonce``
is not this run's (``nonce``; run_identity.py). One with no ``run_nonce`` (written before
run identities, or by a ``Checkpointer`` used without ``Run`` and without the memory tier)
restores as before. A legitimate continuation always matches: a run whose run directory was
lost adopts the nonce of its newest checkpoint (``Checkpointer.newest_run_nonce``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint import download as D
from steadytrain.checkpoint import reader as R
from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.remote import Root, discover
from steadytrain.checkpoint.writer import FAILURES as _FAILURES
from steadytrain.checkpoint.writer import Group
from steadytrain.errors import CheckpointError, StorageError
from steadytrain.storage.store import is_missing

__all__ = ["foreign_run", "restore_latest"]


def foreign_run(manifest: dict[str, Any] | None, nonce: str | None) -> str | None:
    """Why a committed checkpoint belongs to another run (None: it may be restored): its
    COMMIT names a run nonce and it is not ``nonce`` (None: no run to compare with)."""
    theirs = (manifest or {}).get("run_nonce")
    if nonce is None or theirs is None or theirs == nonce:
        return None
    return (
        f"written by another run (nonce {theirs[:12]}..., this run's is {nonce[:12]}...): not "
        "restored. To continue that run, start it with its own run directory (or remove "
        "RUN_DIR/run-identity.json: the run then adopts the newest checkpoint's identity)"
    )


def _candidates(root: Root, nonce: str | None) -> tuple[list[dict], list[dict]]:
    cands, skipped = [], []
    for info in discover(root):
        other = foreign_run(info.manifest, nonce) if info.committed else None
        if other is not None:
            skipped.append({"path": info.name, "step": info.step, "reason": other})
        elif info.committed:
            cands.append({"name": info.name, "step": info.step, "manifest": info.manifest})
        else:
            why = info.error or "no COMMIT (partial: the save never finished)"
            skipped.append({"path": info.name, "step": info.step, "reason": why})
    return cands, skipped


def _json_name(manifest: dict, rank: int) -> str:
    """The JSON state file this rank applies: its own, or rank 0's for a rank the saved job
    did not have."""
    own = rank < int(manifest["world"]["world_size"])
    return f"state-rank{(rank if own else 0):05d}.json"


def _preverify(path: str, manifest: dict, rank: int, part: tuple[int, int]) -> dict[str, bytes]:
    """Names, symlinks and sizes of every file; the small files, each read once and hashed.

    ``.metadata`` (the pickle) and this rank's JSON state are read into memory, checked, and
    later used from these very bytes; the other ranks' JSON files are split among the ranks.
    Shard checksums are left to the reader (before serving, or streamed for "overlap").
    """
    C.verify_local(path, manifest, checksums=False)
    entries = {f["path"]: f for f in manifest["files"]}
    mine = {".metadata", _json_name(manifest, rank)}
    missing = sorted(mine - set(entries))
    if missing:
        raise CheckpointError(
            f"{path}/COMMIT does not list {missing}: the checkpoint is incomplete"
        )
    blobs = {name: R.read_verified(path, entries[name]) for name in sorted(mine)}
    others = [n for n in sorted(entries) if not C.is_shard(n) and n not in mine]
    R.check_files(path, [entries[n] for n in others[part[0] :: part[1]]], threads=1)
    return blobs


def _rank_state(path: str, manifest: dict, rank: int, blobs: dict[str, bytes]) -> dict:
    """This rank's ``state-rankNNNNN.json`` (already checksummed), checked for shape."""
    name = _json_name(manifest, rank)
    doc = S.parse_rank_json(blobs[name], f"{path}/{name}")
    if rank < int(manifest["world"]["world_size"]):
        if not isinstance(doc.get("rng"), dict):
            raise CheckpointError(f'{path}/{name}: has no "rng" object')
        try:  # untrusted input: checked on private generators before anything is loaded
            S.check_rng_state(doc["rng"])
        except Exception as exc:  # noqa: BLE001 - any shape error means: damaged
            raise CheckpointError(
                f'{path}/{name}: its "rng" state is malformed ({type(exc).__name__}: '
                f"{str(exc)[:200]}); the checkpoint is damaged"
            ) from None
    return doc


def _load(
    states: dict[str, Any],
    path: str,
    manifest: dict,
    group: Group,
    blobs: dict[str, bytes],
    rank_json: dict[str, Any],
    mode: str,
    flags: dict[str, Any],
) -> None:
    import torch.distributed.checkpoint as dcp

    template = S.dcp_state_dict(states)
    if template:
        reader = R.VerifyingReader(path, manifest, blobs[".metadata"], group, verify=mode)
        try:
            dcp.load(
                template,
                storage_reader=reader,
                process_group=group.pg,
                no_dist=not group.dist,
            )
        finally:
            flags["touched"] = reader.touched
            flags["verify_error"] = reader.error
            flags["fast_items"], flags["slow_items"] = reader.fast_items, reader.slow_items
        flags["touched"] = True
        S.apply_dcp_state_dict(states, template)
    flags["touched"] = True
    S.apply_json_states(states, rank_json["states"])
    if group.rank < int(manifest["world"]["world_size"]):
        S.set_rng_state(rank_json["rng"])
    else:  # a rank the saved job did not have: deterministic, distinct per rank
        S.seed_rng(S.derive_seed(int(manifest["step"]), group.rank))


def restore_latest(
    states: dict[str, Any],
    group: Group,
    local: Root,
    remote: Root | None,
    verify: str = "full",
    nonce: str | None = None,
) -> dict[str, Any]:
    """Load the newest verified checkpoint into ``states``; returns the ``restore`` event.

    ``verify="full"``: every size and checksum is checked before any live state is written
    (shards by the reader inside ``dcp.load``, each read from disk once).
    ``verify="overlap"`` (local directories): sizes, ``.metadata`` (the pickle) and the JSON
    files are checked first; each shard file is then read once, in order, with tensor bytes
    going straight into the live tensors and every byte hashed on the way. A shard that
    fails its checksum makes the load fail: the next older checkpoint is loaded over it,
    and if none is left a CheckpointError says so (the live state was overwritten). Shards
    are read with torch's weights-only unpickler before their checksum is known.

    Either way the small JSON states are checked against their objects first (the loader
    refuses another seq_len, seed, mixture or dataset, naming both values): a checkpoint
    that verifies but does not fit this job raises ``CheckpointError`` at once, before any
    tensor is written, and is never skipped for an older one (that would silently drop
    progress) nor called damaged. The event's ``changes`` lists what the states accepted
    as changed (a new global batch, from the saved sample position on). ``nonce``: this
    run's; a checkpoint of another run is passed over (``foreign_run``).
    """
    t0 = time.perf_counter()
    root = remote if remote is not None else local
    overlap = verify == "overlap" and remote is None
    part = (group.rank, group.world)  # ranks sharing a directory split the checksumming
    copies = None
    if remote is not None:
        D.sweep(local, group.rank)
        copies = D.NodeCopies.open(group, local, remote)
    found = _candidates(root, nonce) if group.rank == 0 else None
    cands, skipped = group.broadcast(found)
    dirty = False  # live states hold data from a checkpoint that failed verification
    damaged: list[str] = []  # candidates that failed verification (never ones that verify)
    for cand in cands:
        path, blobs, rank_json, ready = "", {}, {}, False
        err: str | None = None
        kind = "damaged"  # or "unreadable" (storage), "mismatch" (verifies, does not fit)
        try:
            if copies is not None:
                path = copies.fetch(cand)  # verified, by the node's ranks together
            else:
                path = os.path.join(local.root, cand["name"])
            blobs = _preverify(path, cand["manifest"], group.rank, part)
            rank_json = _rank_state(path, cand["manifest"], group.rank, blobs)
            ready = True
        except D.ByMate:
            pass  # a rank of this node could not provide its part: its error is reported
        except CheckpointError as exc:
            err = f"rank {group.rank}: {exc}"
        except _FAILURES as exc:  # noqa: BLE001 - storage or OS: not known to be damaged
            err, kind = f"rank {group.rank}: {exc}", "unreadable"
            if isinstance(exc, StorageError) and is_missing(exc):
                kind = "damaged"  # a file its COMMIT lists is gone: incomplete
        if err is None and ready:
            try:  # JSON first: a state that will not load is refused before any tensor is
                S.check_json_states(states, rank_json["states"])
            except _FAILURES as exc:  # noqa: BLE001
                err, kind = f"rank {group.rank}: {exc}", "mismatch"
        gathered = group.all_gather((err, kind, False))
        if not any(e for e, _, _ in gathered):
            # full: every shard checked before any is served; overlap: hashed while read
            # straight into place; a remote checkpoint's local copy is already verified.
            mode = "none" if remote is not None else ("stream" if overlap else "before")
            flags: dict[str, Any] = {"touched": False}
            try:
                _load(states, path, cand["manifest"], group, blobs, rank_json, mode, flags)
            except _FAILURES as exc:  # noqa: BLE001
                err = flags.get("verify_error")
                if not err:  # it verified: the job does not fit it (shapes, names)
                    err = f"rank {group.rank}: load failed: {type(exc).__name__}: {exc}"
                    kind = "mismatch"
            gathered = group.all_gather((err, kind, bool(flags["touched"])))
        downloaded = copies.downloaded if copies is not None else 0
        if copies is not None:
            copies.release()  # every rank of the node is done with this candidate's copy
        errs = list(dict.fromkeys(e for e, _, _ in gathered if e))  # verify errors repeat
        if not errs:
            return {
                "type": "restore",
                "step": cand["step"],
                "tier": "durable",
                "restore_s": time.perf_counter() - t0,
                "bytes_local": 0,
                "bytes_peer": 0,
                "bytes_remote": downloaded,
                "path": root.path(cand["name"]),
                "skipped": skipped,
                "tokens_seen": int(cand["manifest"]["tokens_seen"]),
                # when it committed: a commit the ledger lost is recorded at this start
                "commit_t": cand["manifest"].get("wall_time"),
                "changes": S.json_state_changes(states),
            }
        touched = any(t for _, _, t in gathered)
        kinds = {k for e, k, _ in gathered if e}
        if kinds == {"mismatch"}:
            raise CheckpointError(_mismatch(root, cand["name"], errs, touched, skipped))
        if "unreadable" in kinds and "damaged" not in kinds:
            raise CheckpointError(_unreadable(root, local, cand["name"], errs, dirty or touched))
        # Only a failure after some rank wrote live tensors leaves the state dirty.
        dirty = dirty or touched
        if "damaged" in kinds:
            damaged.append(cand["name"])
        skipped.append({"path": cand["name"], "step": cand["step"], "reason": "; ".join(errs)})
    if dirty:
        raise CheckpointError(
            f"no checkpoint in {root.url} could be restored and a failed load already "
            f"overwrote part of the live state ({skipped[-1]['reason']}); restart the "
            f"process. {_damaged_advice(root, damaged)}"
        )
    return {
        "type": "restore",
        "step": 0,
        "tier": "durable",
        "restore_s": time.perf_counter() - t0,
        "bytes_local": 0,
        "bytes_peer": 0,
        "path": "",
        "skipped": skipped,
        "tokens_seen": 0,
        "changes": [],
    }


def _mismatch(root: Root, name: str, errs: list[str], touched: bool, skipped: list) -> str:
    """The message for a checkpoint that verifies but that this job cannot load."""
    state = (
        "Part of the live state was already overwritten: restart the process once the "
        "settings are fixed."
        if touched
        else "Nothing was loaded: the live state is untouched."
    )
    newer = f" ({len(skipped)} newer entries were skipped first.)" if skipped else ""
    return (
        f"{root.path(name)} verifies, but this job cannot load it: {'; '.join(errs)}. {state} "
        "The checkpoint is intact: keep it. Run with the settings it was saved with to "
        f"resume, or point the checkpoint directory elsewhere to start a new run.{newer}"
    )


def _unreadable(root: Root, local: Root, name: str, errs: list[str], touched: bool) -> str:
    """The message for a checkpoint that could not be read (a full local disk, a dead
    store, a file without read permission): it is not known to be damaged, so an older one
    is not loaded in its place (that would silently drop its progress), nor does the run
    start from scratch beside it."""
    state = (
        "Part of the live state was already overwritten by an earlier attempt: restart the "
        "process once it is fixed."
        if touched
        else "Nothing was loaded."
    )
    return (
        f"{root.url.rstrip('/')}/{name} could not be read: {'; '.join(errs)}. It is not "
        "known to be damaged, so no older checkpoint is loaded in its place. "
        f"{state} Fix the cause (free space in {local.root}, where a remote checkpoint is "
        "downloaded; the store's endpoint or credentials; the files' permissions) and start "
        "the job again."
    )


def _damaged_advice(root: Root, damaged: list[str]) -> str:
    """What to do about checkpoints that failed verification (and only those)."""
    if not damaged:
        return f"`steadytrain checkpoints {root.url}` shows which checkpoints verify."
    return (
        f"These failed verification and cannot be restored: {', '.join(damaged)} "
        f"(`steadytrain checkpoints {root.url}` shows why); copy intact ones back from a "
        "remote or backup copy if you have one, or remove them to start afresh."
    )
