"""Append-only record files that outlive their disk: the one writer under the ledger, the rank
files and the step traces.

A run directory's disk can fill, hit its quota, go read-only or return EIO while training goes
on (checkpoints usually live elsewhere). Losing that disk must not lose training, so nothing
here raises ``OSError`` to its caller:

* every line is written with ``os.write`` on one ``O_APPEND`` descriptor; what the kernel
  did not take (ENOSPC, EDQUOT, EIO, EROFS, ...) waits, in order, in a bounded in-memory
  queue (``max_records`` lines and ``max_bytes`` bytes) and is retried at every later
  ``append``/``flush``. A short write keeps the unwritten tail of its line at the head of
  the queue, so the file never holds half a line followed by another one;
* when the queue is full the oldest unwritten lines are dropped and counted, and one
  ``records_lost`` record takes their place in the file (docs/format.md): their steps, their
  times, their count, the file and the reason. It is written where the lost lines would
  have been, once writing works again;
* the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file: a symlink
  (``ELOOP``), a FIFO (``ENXIO``, never a hang) or a device is refused like a full disk --
  named in one warning, nothing written through it, records queued and counted -- and the
  open is retried later (the fix: remove the link).

One warning names the file when trouble starts, one when writing works again (with what was
written late and what was lost); ``close`` names what could never be written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from steadytrain.storage.regular import NotRegularFileError, open_regular_fd

__all__ = [
    "Appender",
    "MAX_PENDING_RECORDS",
    "MAX_PENDING_BYTES",
    "open_regular",
]

log = logging.getLogger("steadytrain.monitor")

# Enough for minutes of steps of a fast job (a step record is ~300 bytes) and well under the
# memory of any trainer; past it the oldest lines are dropped and a records_lost record says so.
MAX_PENDING_RECORDS = 8192
MAX_PENDING_BYTES = 8 << 20
_CHUNK = 1 << 20  # bytes handed to one os.write


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """``os.open`` that never follows a final symlink, never blocks on a FIFO and returns a
    descriptor only for a regular file; anything else raises ``OSError`` naming the path."""
    return open_regular_fd(path, flags, mode, follow_links=False)


def _reason(exc: OSError) -> tuple[str, str]:
    """(short code for records_lost, words for the warning)."""
    if exc.errno == errno.ELOOP:
        return "ELOOP", "a symlink: nothing is written through it; remove the link"
    if exc.errno == errno.ENXIO:
        return "ENXIO", "a FIFO or socket, not a regular file; remove it"
    if isinstance(exc, NotRegularFileError):
        return "NOT_REGULAR", "not a regular file; remove it"
    code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return code, f"{code}: {exc.strerror or exc}"


@dataclass
class _Line:
    data: bytes
    step: int | None
    t: float | None
    keep: bool = False  # never dropped (the newline that isolates a torn last line)
    kind: str | None = None  # the record's "type"


@dataclass
class _Gap:
    """Lines dropped from the queue: one ``records_lost`` record in their place."""

    count: int = 0
    first_step: int | None = None
    last_step: int | None = None
    t0: float | None = None
    t1: float | None = None
    reason: str = ""
    types: dict[str, int] = field(default_factory=dict)

    def take(self, line: _Line, reason: str) -> None:
        self.count += 1
        self.reason = reason
        kind = line.kind or "untyped"
        self.types[kind] = self.types.get(kind, 0) + 1
        if line.step is not None:
            self.first_step = line.step if self.first_step is None else self.first_step
            self.last_step = line.step
        if line.t is not None:
            self.t0 = line.t if self.t0 is None else min(self.t0, line.t)
            self.t1 = line.t if self.t1 is None else max(self.t1, line.t)

    def encode(self, file: str) -> bytes:
        rec = {
            "type": "records_lost",
            # the newest lost record's time: readers that order by t keep the span in place
            "t": self.t1,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "count": self.count,
            "types": self.types,  # records lost per type, e.g. {"step": 52, "alert": 1}
            "t0": self.t0,
            "t1": self.t1,
            "file": file,
            "reason": self.reason,
        }
        return (json.dumps(rec, separators=(",", ":")) + "\n").encode()


def _meta(rec: Any, key: str) -> Any:
    v = rec.get(key) if isinstance(rec, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return v


class Appender:
    """One append-only JSON-lines file; ``append`` never raises ``OSError``.

    ``label`` names the file in ``records_lost`` records (e.g. ``ledger.jsonl``); ``ok`` is
    False while lines wait or after any were dropped (a snapshot must not cover them)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        label: str | None = None,
        *,
        max_records: int | None = None,
        max_bytes: int | None = None,
        default: Any = None,
    ) -> None:
        self.path = os.fspath(path)
        self.label = label or os.path.basename(self.path)
        # None: the module's bounds, read now (a test may lower them for the whole run)
        self.max_records = max(1, MAX_PENDING_RECORDS if max_records is None else max_records)
        self.max_bytes = max(1, MAX_PENDING_BYTES if max_bytes is None else max_bytes)
        self._default = default
        self._q: deque[_Line | _Gap] = deque()
        self._head_done = 0  # bytes of the queue's first line already in the file
        self._bytes = 0  # bytes queued
        self._fd: int | None = None
        self._error: str | None = None  # the current trouble's code, warned once
        self._late = 0  # lines written after waiting, in this episode
        self.dropped = 0  # lines dropped over the file's life
        self.never_written = 0  # lines still queued at close
        self._dir_synced = False
        self._fsync_warned = False
        if self._open():
            self.flush()  # a torn last line gets its newline now, before anyone reads on

    # -- state -------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Lines (and ``records_lost`` placeholders) waiting in memory."""
        return len(self._q)

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    @property
    def ok(self) -> bool:
        return self._fd is not None and not self._q and not self.dropped

    # -- writing -----------------------------------------------------------------------------
    def append(self, records: Iterable[Any], step_key: str = "step") -> bool:
        """Queue ``records`` (dicts, JSON-encoded one per line) and write what the disk takes.
        True when nothing is left waiting."""
        for rec in records:
            data = (json.dumps(rec, default=self._default, separators=(",", ":")) + "\n").encode()
            kind = rec.get("type") if isinstance(rec, dict) else None
            kind = kind[:40] if isinstance(kind, str) else None
            self._q.append(_Line(data, _meta(rec, step_key), _meta(rec, "t"), kind=kind))
            self._bytes += len(data)
        return self.flush()

    def flush(self) -> bool:
        """Write what waits; True when nothing is left waiting."""
        if self._q and (self._fd is not None or self._open()):
            self._drain()
        self._bound()
        return not self._q

    def sync(self) -> bool:
        """``fsync`` what was written (and, once, the directory). True when it worked."""
        self.flush()
        if self._fd is None:
            return False
        try:
            os.fsync(self._fd)
            if not self._dir_synced:  # the file may be new: its name must last too
                from steadytrain.storage.publish import fsync_dir

                fsync_dir(os.path.dirname(self.path) or ".")
                self._dir_synced = True
        except OSError as exc:
            # What was written stays in the page cache (a machine crash may lose it); the
            # next sync tries again. Not an error of the queue: records keep flowing.
            if not self._fsync_warned:
                log.warning("%s: fsync failed (%s); retried at the next sync", self.path, exc)
                self._fsync_warned = True
            return False
        return True

    def offset(self) -> int:
        """Bytes in the file (every one written by this appender or before it)."""
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def close(self) -> None:
        if self._q:
            self.flush()
        self.sync()
        if self._q:
            lines = sum(g.count if isinstance(g, _Gap) else 1 for g in self._q)
            self.never_written = lines
            log.error(
                "%s: %d record(s) could not be written before close (%s)%s; they are lost",
                self.path,
                lines,
                self._error or "unknown",
                f", {self.dropped} dropped earlier" if self.dropped else "",
            )
            self._q.clear()
            self._bytes = 0
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a writer dropped without close(): no descriptor leaks
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- internals ---------------------------------------------------------------------------
    def _open(self) -> bool:
        try:
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd = open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            self._trouble(exc, "open")
            return False
        try:
            size = os.fstat(fd).st_size
            # A crash mid-write can leave a last line without its newline: start ours on a
            # fresh line so the torn record stays isolated (and skipped by readers).
            if size and os.pread(fd, 1, size - 1) != b"\n":
                self._q.appendleft(_Line(b"\n", None, None, keep=True))
                self._bytes += 1
        except OSError as exc:
            os.close(fd)
            self._trouble(exc, "open")
            return False
        self._fd = fd
        return True

    def _drain(self) -> None:
        assert self._fd is not None
        # While in trouble, probe with the first line alone: a full disk costs one small
        # failed write per batch, not the copy of a megabyte.
        probe = self._error is not None
        while self._q:
            chunk, items = self._chunk(probe)
            try:
                n = os.write(self._fd, chunk)
            except OSError as exc:
                self._trouble(exc, "write")
                return
            self._consume(n, items)
            if n <= 0:
                return
            probe = n < len(chunk)
            # a short write (the disk is nearly full): the loop retries the rest, and the
            # next os.write says ENOSPC if there is really no room
        if self._error is not None:
            log.warning(
                "%s: writing works again; %d record(s) written late%s",
                self.path,
                self._late,
                f", {self.dropped} lost so far (a records_lost record marks them)"
                if self.dropped
                else "",
            )
            self._error, self._late = None, 0

    def _chunk(self, probe: bool = False) -> tuple[bytes, list[bytes]]:
        parts: list[bytes] = []
        size = 0
        for i, item in enumerate(self._q):
            if probe and i:
                break
            if isinstance(item, _Gap):  # frozen into a line once any of it is written
                data = item.encode(self.label)
            else:
                data = item.data
            if i == 0:
                data = data[self._head_done :]
            parts.append(data)
            size += len(data)
            if size >= _CHUNK:
                break
        return b"".join(parts), parts

    def _consume(self, n: int, parts: list[bytes]) -> None:
        for part in parts:
            head = self._q[0]
            if n >= len(part):
                n -= len(part)
                self._q.popleft()
                if isinstance(head, _Line):
                    self._bytes -= len(head.data)
                if self._error is not None:
                    self._late += 1
                self._head_done = 0
                continue
            if n:
                if isinstance(head, _Gap):  # half of it is in the file: it cannot change now
                    whole = head.encode(self.label)
                    self._q[0] = _Line(whole, None, None)
                    self._bytes += len(whole)
                self._head_done += n
            return

    def _bound(self) -> None:
        """Drop the oldest unwritten lines past the bound; one ``_Gap`` stands for them."""
        while len(self._q) > self.max_records or self._bytes > self.max_bytes:
            head = self._q[0]
            # a half-written line must be finished; a kept one stays
            gap_at = 1 if self._head_done or (isinstance(head, _Line) and head.keep) else 0
            if gap_at < len(self._q) and isinstance(self._q[gap_at], _Gap):
                victim_at = gap_at + 1
            else:
                victim_at = gap_at
            if victim_at >= len(self._q):
                return  # only a half-written line and the gap are left: nothing to drop
            victim = self._q[victim_at]
            assert isinstance(victim, _Line)
            del self._q[victim_at]
            self._bytes -= len(victim.data)
            if victim_at == gap_at:
                gap = _Gap()
                self._q.insert(gap_at, gap)
            else:
                gap = self._q[gap_at]
                assert isinstance(gap, _Gap)
            gap.take(victim, self._error or "unknown")
            self.dropped += 1

    def _trouble(self, exc: OSError, what: str) -> None:
        code, words = _reason(exc)
        if self._error is None:
            log.warning(
                "%s: %s failed (%s): records wait in memory (up to %d records / %d MB) and are "
                "written when it works again; older ones are dropped past that and counted. "
                "Free space on that disk (or fix the file) -- training goes on.",
                self.path,
                what,
                words,
                self.max_records,
                self.max_bytes >> 20,
            )
        self._error = code
