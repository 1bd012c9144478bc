"""Declared phases across ranks: a phase one rank declares sets the whole job's deadline.

The watchdog's deadlines are per rank, but a stall is seen by every rank: while one rank is
inside ``with run.phase("eval")`` (480 s by default) the others wait for it in their next
collective under the step deadline (60 s). Left alone, they fire first, name the rank in its
phase "no response", and its own reaper SIGKILLs a healthy process. So each rank's watchdog
thread publishes the phase it is in once it has been in it for a poll, and a rank whose own
deadline passed reads what the other ranks published before it fires (``job_cover``):

- an open phase of another rank holds it until that phase's own deadline has passed
  (the other rank's last progress plus the phase's deadline), so a hang inside a declared
  phase is still found, at that phase's deadline;
- a phase closed at ``t`` is progress of the whole job at ``t``: this rank's own deadline
  counts from there, so no rank fires in the instant between the phase's end and the next
  collective.

Times in the files are wall-clock seconds (ranks on different nodes share no other clock):
nodes need synchronized clocks (NTP), as the ledger's times do.

Files: ``RUN_DIR/hangs/phases/attempt-{A}/phase-rank-{R}.json`` (docs/format.md, part E).
Not in the attempt's hang directory ``hangs/attempt-{A}/``: its appearance tells the reapers
that some rank fired (one ``stat`` a second before, a listing four times a second after),
which a long evaluation must not.

The loop thread does no I/O for any of this: entering and leaving a phase is a list append
or pop and a clock read (``step_done``'s checkpoint phase is entered every step). A phase
shorter than a poll is never published. A rank SIGSTOPped within a poll of entering its
phase has published nothing, so the others find it at their step deadline: a true hang,
found sooner.

The files are untrusted input: read through ``records.read_json`` only when a rank's own
deadline has passed, checked (fields, this attempt, this run's nonce, a rank of this job
other than the reader, the file's own name), its deadline capped at the reader's longest;
anything else is skipped and counted, never a reason to hold a rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from steadytrain.monitor.hangs import hang_dir, read_verdicts
from steadytrain.monitor.records import PHASE_FIELDS, Rejects, check_fields, read_json
from steadytrain.storage.publish import publish_bytes

__all__ = ["Cover", "PhaseBoard", "job_cover", "phase_dir"]

log = logging.getLogger("steadytrain.monitor")

PHASES_DIR = "phases"  # under RUN_DIR/hangs
_NAME = re.compile(r"phase-rank-(\d+)\.json")


def phase_dir(run_dir: str | os.PathLike[str], attempt: int) -> Path:
    """Where attempt ``attempt``'s ranks publish their declared phases."""
    return Path(run_dir) / "hangs" / PHASES_DIR / f"attempt-{attempt}"


@dataclasses.dataclass(frozen=True)
class Cover:
    """Another rank's declared phase that holds this rank until ``until_t`` (wall clock):
    open (``closed_t`` None) until its own deadline, or closed at ``closed_t``."""

    rank: int
    phase: str
    deadline_s: float
    progress_t: float
    until_t: float
    closed_t: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def job_cover(records: list[dict[str, Any]], now_t: float, limit_s: float) -> Cover | None:
    """The declared phase of another rank that holds this rank at wall time ``now_t``
    (this rank's own deadline ``limit_s`` has passed), or None: an open phase until its
    last progress plus its deadline, a closed one until its end plus ``limit_s``; of
    several, the one that holds longest. Times after ``now_t`` count as ``now_t`` (a
    record cannot hold a rank longer by claiming the future)."""
    best: Cover | None = None
    for r in records:
        progress = min(float(r["progress_t"]), now_t)
        closed = r.get("closed_t")
        if r["state"] == "open":
            closed, until = None, progress + float(r["deadline_s"])
        else:
            closed = min(float(closed), now_t)
            until = closed + limit_s
        if until > now_t and (best is None or until > best.until_t):
            best = Cover(
                int(r["rank"]), str(r["phase"]), float(r["deadline_s"]), progress, until, closed
            )
    return best


class PhaseBoard:
    """One rank's side of the exchange, used by its watchdog thread: ``show``/``close``
    publish its own phase when that changed, ``holds`` reads the other ranks' records when
    its own deadline has passed: again only when the hold ran out or a record was published
    since (the directory's mtime, one ``stat`` a poll), never every poll."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        world_size: int,
        attempt: int,
        nonce: str,
        config: Any,
    ) -> None:
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.attempt, self.nonce, self.config = attempt, nonce, config
        self.dir = phase_dir(run_dir, attempt)
        self.path = self.dir / f"phase-rank-{rank}.json"
        self.rejects = Rejects()  # bad files of the other ranks: warned a few times, counted
        self._shown: tuple[Any, ...] | None = None  # what our file says (monotonic times)
        self._record: dict[str, Any] | None = None  # ... and its open record
        # (the progress it holds, the directory's mtime read, until (monotonic), the cover)
        self._held: tuple[float, int | None, float, Cover] | None = None
        self._said: set[tuple[int, str, float | None]] = set()
        self._failed = False

    # -- this rank -------------------------------------------------------------------------
    def show(
        self,
        key: int,
        entered: float,
        phase: str,
        phases: list[str],
        progress: float,
        deadline_s: float,
    ) -> None:
        """This rank is inside ``phase`` (the open phase whose deadline is in force; ``key``
        and ``entered`` name the outermost open one, ``phases`` every open one, ``progress``
        the last progress: monotonic times). Written only when something changed."""
        shown = (key, entered, phase, deadline_s, progress)
        if shown == self._shown:
            return
        self._shown = shown
        self._record = {
            "rank": self.rank,
            "attempt": self.attempt,
            "nonce": self.nonce,
            "pid": os.getpid(),
            "phase": phase,
            "phases": phases,
            "state": "open",
            "entered_t": wall(entered),
            "progress_t": wall(progress),
            "deadline_s": deadline_s,
            "closed_t": None,
        }
        self._write(self._record)

    def close(self, left: float) -> None:
        """The phase shown last ended at ``left`` (monotonic); nothing if none is shown."""
        if self._record is not None:
            doc = {**self._record, "state": "closed", "closed_t": wall(left)}
            self._shown = self._record = None
            self._write(doc)

    def _write(self, doc: dict[str, Any]) -> None:
        try:  # losing it costs only the others' patience, never a reason not to train
            self.dir.mkdir(parents=True, exist_ok=True)
            publish_bytes(str(self.path), json.dumps(doc), durable=False)
        except OSError as e:
            if not self._failed:
                log.warning(
                    "hang watchdog: %s not written (%s); other ranks may fire "
                    "at their own deadline while this rank is in a long phase",
                    self.path,
                    e,
                )
            self._failed = True

    # -- the other ranks -------------------------------------------------------------------
    def holds(self, now: float, progress: float, seen: dict[str, Any]) -> bool:
        """True while another rank's declared phase holds this rank, whose own deadline
        (``seen``, the watchdog's ``check``) has passed at ``now`` (monotonic) with its last
        progress at ``progress``. A held rank joins (False) as soon as another rank of this
        attempt fired: a verdict of it is on disk."""
        held, seen_dir = self._held, self._mtime()
        if held is None or held[:2] != (progress, seen_dir) or now >= held[2]:
            limit = seen["deadline_s"]
            cap = max(self.config.longest_static_s, limit)
            now_t = wall(now)
            cover = job_cover(self.read(cap), now_t, limit)
            if cover is None:
                return False  # fire; held_by still names what held this rank last
            self._held = (progress, seen_dir, now + cover.until_t - now_t, cover)
            self._say(cover, seen)
        return not self._fired_elsewhere()

    def _mtime(self) -> int | None:
        """The phase directory's modification time: a record published (renamed in) since
        the last read changes it, so one ``stat`` a poll tells whether to read again."""
        try:
            return os.stat(self.dir).st_mtime_ns
        except OSError:
            return None

    def held_by(self, progress: float) -> dict[str, Any] | None:
        """The other rank's declared phase that held this rank since its last progress."""
        held = self._held
        return held[3].to_dict() if held is not None and held[0] == progress else None

    def read(self, cap_s: float) -> list[dict[str, Any]]:
        """The other ranks' records of this attempt and run; deadlines capped at
        ``cap_s`` (the reader's own longest: a record cannot hold a rank longer)."""
        try:
            names = sorted(os.listdir(self.dir))
        except OSError:
            return []  # nobody published a phase (or the directory is unreachable)
        out = []
        for name in names:
            m = _NAME.fullmatch(name)
            if m is None or int(m.group(1)) == self.rank:
                continue  # a temporary file, or ours
            label = f"hangs/{PHASES_DIR}/{self.dir.name}/{name}"
            rec = read_json(self.dir / name, root=self.run_dir, rejects=self.rejects, label=label)
            why = self._why(rec, int(m.group(1))) if rec is not None else None
            if why is not None:
                self.rejects.add(label, why, str(self.dir / name))
            elif rec is not None:
                out.append({**rec, "deadline_s": min(float(rec["deadline_s"]), cap_s)})
        return out

    def _why(self, rec: Any, rank: int) -> str | None:
        """Why record ``rec`` of file ``phase-rank-{rank}.json`` is not used, or None."""
        if not isinstance(rec, dict):
            return "not a JSON object"
        why = check_fields(rec, PHASE_FIELDS, "phase record")
        if why is not None:
            return why
        if rec["rank"] != rank or rank >= self.world_size:
            return f"rank {rec['rank']} in the file of rank {rank} of a world of {self.world_size}"
        if rec["attempt"] != self.attempt or rec["nonce"] != self.nonce:
            return "another attempt's or another run's (attempt or nonce differs)"
        if rec["state"] not in ("open", "closed") or (
            rec["state"] == "closed" and rec.get("closed_t") is None
        ):
            return f"state {rec['state']!r} (open, or closed with closed_t)"
        return None

    def _fired_elsewhere(self) -> bool:
        d = hang_dir(self.run_dir, self.attempt)
        if not d.is_dir():  # one stat: the directory appears when some rank fires
            return False
        nonce = self.nonce or None
        got = read_verdicts(d, self.rejects, nonce=nonce, world_size=self.world_size)
        return any(r != self.rank for r in got)

    def _say(self, cover: Cover, seen: dict[str, Any]) -> None:
        key = (cover.rank, cover.phase, cover.closed_t)
        if key not in self._said:
            self._said.add(key)
            what = "left" if cover.closed_t is not None else "is inside"
            log.info(
                "hang watchdog: rank %d past its %s deadline (%.1fs), but rank %d %s its "
                "declared phase %r (deadline %.1fs): waiting up to %.1fs more",
                self.rank,
                seen["phase"],
                seen["deadline_s"],
                cover.rank,
                what,
                cover.phase,
                cover.deadline_s,
                cover.until_t - time.time(),
            )


def wall(mono: float) -> float:
    """A monotonic time of this process as wall-clock time (what other nodes can compare)."""
    return mono + (time.time() - time.monotonic())
