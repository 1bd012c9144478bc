"""One live writer per checkpoint root: the writer lease (and the same mechanism for one
live job per run directory: ``RUN_LEASE``, taken by ``steadytrain.Run``, run_lease.py).

Two jobs saving into one root picked the same ``step-N`` names, wrote the same file names
and deleted each other's saves in flight. Directory claims (``claim.py``) stop the mixing;
this lease stops the second job, by name, at its first save.

Layout: ``ROOT/.writer-lease/GGGGGGGG.json``, one record per *generation* (docs/format.md);
the highest generation holds the root. A generation is only ever created if absent
(``Store.write_bytes_if_absent``: a hard link locally, ``If-None-Match: *`` on S3), so of two
jobs that both find generation ``g`` free exactly one creates ``g + 1``. A holder rewrites
only its own generation (heartbeat, release); the next holder deletes older ones.

A holder's lease is free (``_free_because``; docs/checkpoint.md, "One writer per root") when
it was released or is this process's; when it names this job's identity (a restart); when
its pid is gone from this host; or when its heartbeat, refreshed every ``timeout_s / 10`` by
one thread per process, is older than ``timeout_s``. Anything else is a live job:
``CheckpointError`` naming the root, the holder and the fix. A holder that finds a newer
generation than its own has lost the root (``LeaseLostError``) and must stop saving.

A ``LeaseKind`` (``lease_kinds.py``) names what a lease guards: ``WRITER`` a checkpoint
root, ``RUN_LEASE`` a run directory. Both share every rule above, the registry and the
heartbeat thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import uuid
from typing import Any

from steadytrain.checkpoint.identity import host_identity, pid_gone, proc_start
from steadytrain.checkpoint.lease_kinds import (
    FORMAT,
    LEASE_DIR,
    RUN_LEASE,
    VERSION,
    WRITER,
    LeaseKind,
)
from steadytrain.checkpoint.regular import read_regular
from steadytrain.errors import CheckpointError, StorageError
from steadytrain.storage.store import Store, is_missing

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FORMAT",
    "LEASE_DIR",
    "RUN_LEASE",
    "VERSION",
    "WRITER",
    "Lease",
    "LeaseKind",
    "LeaseLostError",
    "acquire",
]

log = logging.getLogger("steadytrain.checkpoint")

DEFAULT_TIMEOUT_S = 300.0
_TRIES = 8  # generations contested in a row before giving up (other jobs keep winning)


class LeaseLostError(CheckpointError):
    """Another job took this job's writer lease: this job must stop writing checkpoints."""


def _me(job: str, timeout_s: float, kind: LeaseKind) -> dict[str, Any]:
    pid = os.getpid()
    started = proc_start(pid)
    return {
        "format": kind.format,
        "version": VERSION,
        **host_identity(),
        "pid": pid,
        "pid_start": started[1] if started else None,
        "job": job,
        "timeout_s": timeout_s,
    }


def _describe(rec: dict[str, Any]) -> str:
    if not rec.get("host"):
        return "another job (its lease record is unreadable or gone)"
    job = rec.get("job") or "(no job id)"
    return f"host {rec.get('host')} pid {rec.get('pid')} job {job}"


def _free_because(
    holder: dict[str, Any], me: dict[str, Any], now: float, timeout_s: float
) -> str | None:
    """Why ``holder``'s lease may be taken over, or None when it belongs to a live job."""
    if holder.get("released"):
        return "it was released"
    if holder.get("unreadable"):
        return "it was not a lease record"
    if holder.get("job") and holder.get("job") == me["job"]:
        return f"same job ({me['job']}): a restart"
    same_host = all(holder.get(k) == me[k] for k in ("host", "boot_id", "pid_ns"))
    if same_host and isinstance(holder.get("pid"), int):
        if holder["pid"] == me["pid"] and holder.get("pid_start") == me["pid_start"]:
            return "it is this process"
        if pid_gone(holder["pid"], holder.get("pid_start")):
            return f"its process {holder['pid']} on this host is gone"
    limit = max(timeout_s, float(holder.get("timeout_s") or 0.0))
    age = now - float(holder.get("heartbeat") or 0.0)
    if age > limit:
        return f"its heartbeat is {age:.0f} s old (limit {limit:.0f} s)"
    return None


class Lease:
    """A held generation of a lease on one root (shared by the holders of one process on
    that root, e.g. its Checkpointers: ``refs``)."""

    def __init__(
        self, store: Store, generation: int, record: dict[str, Any], kind: LeaseKind = WRITER
    ) -> None:
        self.store = store
        self.kind = kind
        self.generation = generation
        self.record = record
        self.refs = 1
        self.lost: str | None = None
        self.period_s = float(record["timeout_s"]) / 10
        self.next_beat = time.monotonic() + self.period_s
        self._lock = threading.Lock()  # heartbeat thread vs. the saving thread

    @property
    def url(self) -> str:
        return self.store.display(self._relname)

    def _lose(self, top: int) -> LeaseLostError:
        with _REGISTRY_LOCK:
            if _HELD.get(_key(self.store, self.kind)) is self:
                del _HELD[_key(self.store, self.kind)]  # the next acquire starts afresh
        holder = _read(self.store, top, self.kind) or {}
        self.lost = (
            f"{self.store.url}: this job lost the {self.kind.title} to {_describe(holder)} "
            f"(generation {top}, ours was {self.generation}; it took over because "
            f"{holder.get('took_over', 'our lease was gone')}). {self.kind.lost}"
        )
        return LeaseLostError(self.lost)

    def check(self) -> None:
        """Raise ``LeaseLostError`` if a newer generation exists (the fence rank 0 runs before
        claiming each checkpoint directory). A generation of ours that someone deleted, with
        none newer, is written again: nobody else holds the root."""
        if self.lost:
            raise LeaseLostError(self.lost)
        gens = _generations(self.store, self.kind)
        if gens and gens[-1] > self.generation:
            raise self._lose(gens[-1])
        if self.generation not in gens:
            data = json.dumps(self.record, sort_keys=True).encode()
            if not self.store.write_bytes_if_absent(self._relname, data):
                mine = _read(self.store, self.generation, self.kind) or {}
                if mine.get("token") != self.record["token"]:
                    raise self._lose(self.generation)

    def beat(self) -> None:
        """Refresh the heartbeat, after checking the lease is still ours. A generation that
        is gone (its root deleted) is left gone: only a save writes into the root again."""
        with self._lock:
            if self.lost:
                raise LeaseLostError(self.lost)
            gens = _generations(self.store, self.kind)
            if gens and gens[-1] > self.generation:
                raise self._lose(gens[-1])
            if self.generation in gens:
                self.record["heartbeat"] = time.time()
                self._write()
            self.next_beat = time.monotonic() + self.period_s

    @property
    def _relname(self) -> str:
        return _name(self.kind, self.generation)

    def _write(self) -> None:
        data = json.dumps(self.record, sort_keys=True).encode()
        self.store.write_bytes_atomic(self._relname, data)

    def release(self) -> None:
        """Drop one reference; the last one marks the generation released, so the next job
        takes over at once (no waiting for a heartbeat to age)."""
        with _REGISTRY_LOCK:
            self.refs -= 1
            if self.refs > 0:
                return
            if _HELD.get(_key(self.store, self.kind)) is self:
                del _HELD[_key(self.store, self.kind)]
        with self._lock:
            if self.lost:
                return
            try:
                gens = _generations(self.store, self.kind)
                if gens and gens[-1] == self.generation:  # still ours, and still there
                    self.record["released"] = True
                    self._write()
            except (CheckpointError, StorageError, OSError) as exc:
                log.warning("could not release the %s %s: %s", self.kind.noun, self.url, exc)


_GEN_RE = re.compile(r"^([0-9]{8,18})\.json$", re.ASCII)  # '²'.isdigit() is True: not here
_MAX_RECORD_BYTES = 1 << 20  # a real record is ~500 bytes
_warned_names: set[str] = set()


def _name(kind: LeaseKind, generation: int) -> str:
    return f"{kind.dirname}/{generation:08d}.json"


def _generations(store: Store, kind: LeaseKind = WRITER) -> list[int]:
    """Generations present, from names ``GGGGGGGG.json`` exactly as written (8+ ASCII
    digits, no extra leading zeros); any other name is ignored and reported once."""
    out = []
    for entry in store.listdir(kind.dirname):
        base = entry.rstrip("/").rsplit("/", 1)[-1]
        m = _GEN_RE.match(base)
        if m and f"{int(m.group(1)):08d}" == m.group(1):
            out.append(int(m.group(1)))
        elif not base.startswith(".") and base not in _warned_names:  # temporaries: ".…"
            _warned_names.add(base)
            log.warning(
                "%s: not a %s name (GGGGGGGG.json, ASCII digits); ignored. Remove it if "
                "nothing of yours wrote it",
                store.display(f"{kind.dirname}/{base}"),
                kind.noun,
            )
    return sorted(out)


def _read_raw(store: Store, name: str) -> bytes | None:
    """A lease file's bytes; None when missing. Locally only a regular file is opened (a
    FIFO there blocked every start) and at most ``_MAX_RECORD_BYTES + 1`` bytes are read."""
    path = store.local_path(name)
    if path is None:
        try:
            return store.read_bytes(name)
        except StorageError as exc:
            if is_missing(exc):
                return None
            raise
    try:
        return read_regular(path, limit=_MAX_RECORD_BYTES + 1)
    except CheckpointError as exc:
        if "missing" in str(exc) and not os.path.lexists(path):
            return None
        log.warning("%s", exc)
        return b""  # not a lease record: reported, and replaced by the next holder


def _record_problem(rec: dict[str, Any]) -> str | None:
    """What in a version-1 lease record breaks docs/format.md's table, or None."""
    for key in ("host", "boot_id", "pid_ns", "job", "token"):
        if not isinstance(rec.get(key, ""), str):
            return f"{key}={rec.get(key)!r} is not a string"
    pid = rec.get("pid")
    if pid is not None and (type(pid) is not int or not 0 <= pid < 1 << 31):
        return f"pid={pid!r} is not a process id"
    if not isinstance(rec.get("pid_start"), (str, type(None))):
        return f"pid_start={rec.get('pid_start')!r} is neither a string nor null"
    for key in ("timeout_s", "heartbeat", "acquired"):
        value = rec.get(key, 0.0)
        if value is not None and not (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        ):
            return f"{key}={value!r} is not a non-negative number"
    if not isinstance(rec.get("released", False), bool):
        return f"released={rec.get('released')!r} is not a boolean"
    return None


def _read(store: Store, generation: int, kind: LeaseKind = WRITER) -> dict[str, Any] | None:
    """Generation ``generation``'s record; None when it vanished (a newer holder deleted it).
    A file that is not a valid lease record (not JSON, wrong types, a FIFO, oversized) is
    reported and returned as ``{"unreadable": True}``: the next holder may replace it. Only
    a record from a newer steadytrain (a higher ``version``) is refused, naming the fix."""
    name = _name(kind, generation)
    raw = _read_raw(store, name)
    if raw is None:
        return None
    problem = None
    rec: Any = None
    if len(raw) > _MAX_RECORD_BYTES:
        problem = f"more than {_MAX_RECORD_BYTES} bytes"
    else:
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            problem = f"not JSON ({str(exc)[:100]})"
    version = rec.get("version") if isinstance(rec, dict) else None
    if problem is None and (not isinstance(rec, dict) or rec.get("format") != kind.format):
        problem = f"its format is not {kind.format!r}"
    elif problem is None and type(version) is int and version > VERSION:
        raise kind.error(
            f"{store.display(name)}: {kind.noun} version {version}, this steadytrain reads "
            f"version {VERSION}; upgrade steadytrain to use this {kind.place}"
        )
    elif problem is None and version != VERSION:
        problem = f"version={version!r} is not a lease version"
    elif problem is None:
        problem = _record_problem(rec)
    if problem is not None:
        log.warning(
            "%s is not a valid %s record (%s); the next holder replaces it",
            store.display(name),
            kind.noun,
            problem,
        )
        return {"unreadable": True}
    return rec


_HELD: dict[tuple[int, str, str], Lease] = {}
_REGISTRY_LOCK = threading.Lock()  # held briefly: the heartbeat thread takes it too
_ACQUIRE_LOCK = threading.Lock()  # one acquisition at a time (its I/O may retry for minutes)
_BEATER: threading.Thread | None = None
_WAKE = threading.Event()  # a new lease may need an earlier heartbeat than the one planned
_WARNED_UNCONDITIONAL: set[str] = set()


def _key(store: Store, kind: LeaseKind) -> tuple[int, str, str]:
    return os.getpid(), store.root if store.is_local else store.url, kind.dirname


def acquire(
    store: Store,
    *,
    job: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kind: LeaseKind = WRITER,
) -> Lease:
    """Take (or share, within this process) the ``kind`` lease on ``store``'s root, or raise
    ``kind.error`` (``CheckpointError`` for the writer lease) naming the live job that holds
    it. Storage errors propagate."""
    with _ACQUIRE_LOCK:
        with _REGISTRY_LOCK:
            held = _HELD.get(_key(store, kind))
            if held is not None and held.lost is None:
                held.refs += 1
                return held
        lease = _acquire(store, job, timeout_s, kind)
        with _REGISTRY_LOCK:
            _HELD[_key(store, kind)] = lease
            _start_beater()
        _WAKE.set()
        return lease


def _acquire(store: Store, job: str, timeout_s: float, kind: LeaseKind) -> Lease:
    me = _me(job, timeout_s, kind)
    token = uuid.uuid4().hex
    for _ in range(_TRIES):
        gens = _generations(store, kind)
        why, previous = "there was no lease", None
        if gens:
            holder = _read(store, gens[-1], kind)
            if holder is None:
                continue  # deleted under us by a new holder: look again
            now = time.time()
            why = _free_because(holder, me, now, timeout_s)
            if why is None:
                raise kind.error(_refusal(store, gens[-1], holder, now, timeout_s, kind))
            previous = {k: holder.get(k) for k in ("host", "pid", "job", "heartbeat")}
        generation = (gens[-1] if gens else 0) + 1
        now = time.time()
        rec = dict(
            me, generation=generation, token=token, acquired=now, heartbeat=now, released=False
        )
        rec.update(took_over=why, previous=previous)
        data = json.dumps(rec, sort_keys=True).encode()
        name = _name(kind, generation)
        if not store.write_bytes_if_absent(name, data):
            mine = _read(store, generation, kind)
            if not mine or mine.get("token") != token:
                continue  # another job won this generation: judge it on the next round
        _check_conditional(store, name, data)
        for old in gens:  # only the holder's generation matters; older ones are history
            try:
                store.remove(_name(kind, old))
            except (StorageError, OSError, ValueError) as exc:  # a directory there, say
                log.warning("could not delete an old %s on %s: %s", kind.noun, store.url, exc)
        if previous is not None:
            log.info("%s on %s taken over from %s: %s", kind.noun, store.url, previous, why)
        return Lease(store, generation, rec, kind)
    raise kind.error(
        f"{store.url}: could not take the {kind.title}: {_TRIES} generations in a row went "
        f"to other jobs ({store.display(kind.dirname)}); several jobs are starting on one "
        f"{kind.place} at once: start only one"
    )


def _check_conditional(store: Store, name: str, data: bytes) -> None:
    """A second create of the same object must fail; on a store that ignores
    ``If-None-Match`` it succeeds (rewriting the same bytes) and claims are not exclusive."""
    if store.is_local or store.url in _WARNED_UNCONDITIONAL:
        return
    if store.write_bytes_if_absent(name, data):
        _WARNED_UNCONDITIONAL.add(store.url)
        log.warning(
            "%s ignores conditional PUTs (If-None-Match): two jobs that start at the same "
            "moment could both take the writer lease and claim the same checkpoint names; "
            "a job that starts later is still refused. Use a store that supports them "
            "(AWS S3, SeaweedFS, recent MinIO)",
            store.url,
        )


def _refusal(
    store: Store,
    generation: int,
    holder: dict[str, Any],
    now: float,
    timeout_s: float,
    kind: LeaseKind,
) -> str:
    limit = max(timeout_s, float(holder.get("timeout_s") or 0.0))
    age = now - float(holder.get("heartbeat") or 0.0)
    lease = store.display(_name(kind, generation))
    return (
        f"{store.url} is the {kind.place} of another live job: {_describe(holder)} holds "
        f"its {kind.noun} ({lease}, heartbeat {age:.0f} s ago). {kind.harm} Fix: "
        f"{kind.fix.format(lease=lease)}. If that job is dead on another host, "
        f"its lease expires when its heartbeat is {limit:.0f} s old (in about "
        f"{max(0.0, limit - age):.0f} s); a restart of the same job is recognised at once by "
        "its job identity (TORCHELASTIC_RUN_ID from torchrun --rdzv-id, SLURM_JOB_ID, or "
        "checkpoint job_id)"
    )


def _start_beater() -> None:
    """One daemon thread per process refreshes every held lease (called under the lock)."""
    global _BEATER
    if _BEATER is not None and _BEATER.is_alive():
        return
    _BEATER = threading.Thread(target=_beat_forever, name="steadytrain-lease", daemon=True)
    _BEATER.start()


def _beat_forever() -> None:
    global _BEATER
    while True:
        _WAKE.clear()
        with _REGISTRY_LOCK:
            leases = [le for (pid, _, _), le in _HELD.items() if pid == os.getpid()]
            if not leases:
                _BEATER = None  # the next acquire starts a new one
                return
        now = time.monotonic()
        for lease in leases:
            if now < lease.next_beat:
                continue
            try:
                lease.beat()
            except LeaseLostError as exc:
                log.error("%s", exc)
            except Exception as exc:  # noqa: BLE001 - the store may be down: try again later
                log.warning("%s heartbeat on %s failed: %s", lease.kind.noun, lease.store.url, exc)
                lease.next_beat = now + lease.period_s
        _WAKE.wait(max(0.05, min(le.next_beat for le in leases) - time.monotonic()))


def _after_fork_in_child() -> None:
    """A forked child holds no lease (its pid differs) and must not inherit a lock that the
    parent's heartbeat thread held at the moment of the fork."""
    global _REGISTRY_LOCK, _ACQUIRE_LOCK, _BEATER
    _REGISTRY_LOCK, _ACQUIRE_LOCK = threading.Lock(), threading.Lock()
    _HELD.clear()
    _BEATER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
