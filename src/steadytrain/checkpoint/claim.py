"""Claiming a checkpoint directory name, so two writers never share one directory.

Rank 0 picks the first ``step-N`` (``.1``, ``.2``... for a step that already has one) that
no listing shows and that *this call* creates: ``os.mkdir`` locally (create-or-fail, never
``exist_ok``: that was how two jobs ended up writing the same files), and with ``remote=``
also a ``CLAIM`` object created only if absent (``Store.write_bytes_if_absent``:
``If-None-Match: *`` on S3). A name someone else created first is skipped. The writer lease
(``lease.py``) refuses a second job outright; the claim is what holds even when two writers
slip past it (a store that ignores conditional PUTs, a lease taken over from a paused job).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint.remote import Root
from steadytrain.errors import CheckpointError, StorageError
from steadytrain.storage.publish import fsync_dir

__all__ = ["CLAIM_NAME", "claim_name"]

CLAIM_NAME = "CLAIM"  # on a remote: the claim of a checkpoint directory (docs/format.md)
_MAX_ATTEMPTS = 1000  # directories of one step (step-N, step-N.1, ...) before giving up


def claim_name(local: Root, remote: Root | None, step: int, job: str = "") -> str:
    """Rank 0: the first ``step-N[.k]`` name that was never used here and that this call
    claimed (the local directory created by this call, and the remote CLAIM too)."""
    os.makedirs(local.root, exist_ok=True)
    taken = set(local.listdir()) | (set(remote.listdir()) if remote is not None else set())
    token = uuid.uuid4().hex
    who = {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "t": time.time()}
    body = json.dumps({"step": step, "token": token, **who}).encode()
    for attempt in range(_MAX_ATTEMPTS):
        name = C.step_dirname(step, attempt)
        if name in taken:
            continue  # a directory is never reused, not even a partial one
        path = os.path.join(local.root, name)
        try:
            os.mkdir(path)  # the claim: create-or-fail, so two writers never share it
        except FileExistsError:
            continue  # claimed by another writer since the listing
        if remote is None or _claim_remote(remote, name, body, token):
            # The new directory's name must survive a power loss as its COMMIT will (which
            # fsyncs the directory's own entries, not this one); cheap before the data.
            fsync_dir(local.root)
            return name
        os.rmdir(path)  # the remote name is someone else's: ours stays unused
    raise CheckpointError(
        f"{local.root}: {_MAX_ATTEMPTS} directories for step {step} already exist; "
        "something saves this step over and over: look at the partial directories there"
    )


def _claim_remote(remote: Root, name: str, body: bytes, token: str) -> bool:
    if remote.store.write_bytes_if_absent(f"{name}/{CLAIM_NAME}", body):
        return True
    try:  # a PUT retried after a lost answer finds its own claim: still ours
        return json.loads(remote.read_bytes(name, CLAIM_NAME)).get("token") == token
    except (ValueError, AttributeError, RecursionError, StorageError):  # not a claim: not ours
        return False
