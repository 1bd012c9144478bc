"""A run's identity: one random nonce, made with the run's first records, that every durable
checkpoint, memory snapshot and hang decision of the run carries.

Why (issue 40): a run directory that is reused (``rm -rf RUN`` and a new run under the same
name, a fixed ``--rdzv-id``), a memory directory another local user can write into, a file
dropped into ``RUN_DIR/hangs/``: each handed the job state or a verdict it did not make. A
name derived from paths or job ids is predictable and repeats; a nonce does not. So:

- rank 0 reads ``RUN_DIR/run-identity.json`` at entry (``establish``); when there is none it
  adopts the nonce of the run whose durable checkpoints it is pointed at (``adopt``: the run
  directory was lost, the checkpoints say which run this is), else makes a new one, and
  publishes it without replacing anything (a hard link: of two racing starts one wins and
  both use the winner's);
- ``Run`` broadcasts it to every rank and hands it to the checkpointer (stamped into each
  COMMIT and snapshot; a snapshot of another nonce is never restored), the watchdog and the
  reapers (a decision file must carry it), and the ledger's ``job_start``.

The file is untrusted input like every record (DESIGN, "Records are input too"): a file that
is not a regular file, too large, not ours, or not this format is replaced by a new identity
with a warning (what that costs: this run's memory snapshots are not restored, which is the
safe direction), never a reason not to train.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable

from steadytrain.storage.publish import publish_bytes, publish_bytes_if_absent

__all__ = ["IDENTITY_FILE", "RunIdentity", "establish", "is_nonce", "new_nonce", "read"]

log = logging.getLogger("steadytrain")

IDENTITY_FILE = "run-identity.json"
FORMAT = "steadytrain-run-identity"
VERSION = 1
NONCE_HEX = 32  # 128 random bits
MAX_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """``nonce``: the run's identity. ``origin``: ``"existing"`` (read from the run
    directory), ``"adopted"`` (taken from the newest durable checkpoint), ``"new"``."""

    nonce: str
    origin: str


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def is_nonce(value: object) -> bool:
    """A well-formed nonce: ``NONCE_HEX`` lowercase hex digits."""
    return (
        isinstance(value, str)
        and len(value) == NONCE_HEX
        and all(c in "0123456789abcdef" for c in value)
    )


def _doc(nonce: str) -> bytes:
    return json.dumps(
        {"format": FORMAT, "version": VERSION, "nonce": nonce, "created_t": time.time()}
    ).encode()


def read(run_dir: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """``(nonce, problem)``: the run directory's nonce, or None with why it is unusable
    (problem None: there is no identity file)."""
    path = os.path.join(os.fspath(run_dir), IDENTITY_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be opened ({e.strerror or e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            return None, f"owned by uid {st.st_uid}, not this user ({os.getuid()})"
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        return None, f"larger than {MAX_BYTES} bytes"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "not JSON"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None, f"not a {FORMAT} document"
    if doc.get("version") != VERSION:
        return None, f"version {doc.get('version')!r}, this steadytrain reads {VERSION}"
    if not is_nonce(doc.get("nonce")):
        return None, "no well-formed nonce"
    return doc["nonce"], None


def establish(
    run_dir: str | os.PathLike[str], adopt: Callable[[], str | None] | None = None
) -> RunIdentity:
    """The run's identity, made on first use (module docstring). Call on one rank (rank 0)
    and broadcast. ``adopt``: returns the nonce of the newest durable checkpoint this run
    would restore (None: none, or it carries none); asked only when the run directory holds
    no identity."""
    run_dir = os.fspath(run_dir)
    nonce, problem = read(run_dir)
    if nonce is not None:
        return RunIdentity(nonce, "existing")
    path = os.path.join(run_dir, IDENTITY_FILE)
    adopted = None
    if adopt is not None and problem is None:
        try:
            adopted = adopt()
        except Exception as e:
            # The checkpoints could not be listed: a nonce made now and published would
            # disown them for good (their nonce never matches again). Keep it in memory;
            # the next attempt asks again. The restore reports the listing's failure.
            log.warning(
                "run identity: the checkpoints' run could not be read (%s); this attempt "
                "uses an identity of its own and does not publish it",
                e,
            )
            return RunIdentity(new_nonce(), "new")
        adopted = adopted if is_nonce(adopted) else None
    made = RunIdentity(adopted or new_nonce(), "adopted" if adopted else "new")
    try:
        return _publish(run_dir, path, made, problem)
    except OSError as e:  # a full or read-only run directory never stops training
        log.warning(
            "%s could not be written (%s): this attempt keeps its identity in memory; a "
            "later attempt makes a new one and will not restore this one's memory snapshots",
            path,
            e.strerror or e,
        )
        return made


def _publish(run_dir: str, path: str, made: RunIdentity, problem: str | None) -> RunIdentity:
    os.makedirs(run_dir, exist_ok=True)
    if problem is not None:
        log.warning(
            "%s is unusable (%s): replaced by a new run identity; memory snapshots of "
            "the run before it will not be restored",
            path,
            problem,
        )
        try:
            os.unlink(path)  # never written through: the name itself is replaced
        except FileNotFoundError:
            pass
        publish_bytes(path, _doc(made.nonce))
        return made
    if publish_bytes_if_absent(path, _doc(made.nonce)):
        return made
    nonce, problem = read(run_dir)  # another start won the race: use its identity
    if nonce is not None:
        return RunIdentity(nonce, "existing")
    log.warning("%s appeared but is unusable (%s): using a new identity", path, problem)
    return made
