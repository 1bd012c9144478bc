"""The reaper: a small child process of each rank that SIGKILLs the rank once its attempt's
hang is decided and the rank cannot end itself.

A SIGSTOPped rank (or one whose watchdog thread cannot run: the GIL held in C code, a
kernel wait) answers nothing: its own watchdog cannot exit it, and torchrun's SIGTERM stays
pending on a stopped process until torchrun's grace (30 s) runs out. Something else on the
same node must kill it, and a child of a stopped process keeps running. So the hang
watchdog (watchdog.py) starts one reaper per rank (``spawn``, only when there is more than
one rank) that watches nothing but its own parent:

- every ``idle_s`` it checks that its parent is still its parent (else it exits: no
  leftovers) and whether the attempt's hang directory ``RUN_DIR/hangs/attempt-{A}/`` exists
  (one ``stat``); only once it does, every ``poll_s`` it reads the decisions the answering
  ranks publish there (``decision-{R}.json``: the stuck and the silent ranks);
- a decision counts only when it is this job's own: a regular file owned by this user,
  of this attempt, carrying the run's nonce (given in the reaper's environment, which only
  this user can read, never on its command line, which every local user can read in
  ``/proc``), from a rank of the job, named after it, and naming only ranks of
  ``range(world_size)``. Anything else (a file dropped into ``RUN_DIR/hangs/``, another
  run's) is refused with one line naming it, and kills nothing;
- a stopped parent (``/proc`` state ``T``/``t``) answers nothing: once the directory
  exists the reaper says so (``stopped-rank-{R}.json``: rank, pid, state, time, the nonce),
  so the answering ranks decide at once instead of waiting out their ``grace_s`` for a
  verdict that cannot come (in-place recovery's SIGSTOP path pays no grace);
- its parent is then SIGKILLed at once when it is stopped (``/proc`` state ``T``/``t``), or
  when a decision names it stuck and it published no verdict of its own (it cannot act) --
  after rank 0's hang record is on disk (``recorded.json``), as the answering ranks' own
  exits wait for it, unless rank 0 is the silent one, and at most ``record_wait_s`` later;
- a parent that answered exits by itself (the watchdog's ``os._exit``); if it is still
  alive ``backstop_s`` after the decision, it is SIGKILLed all the same;
- a SIGTERM to the reaper (torchrun stops the whole process group of a worker) while its
  parent is stopped: the parent can never act on its own SIGTERM, so it is SIGKILLed now.

Every kill is published as ``reaped-rank-{R}.json`` in the hang directory (docs/format.md):
rank, node, pid, the ``/proc`` state before the kill and its name, the signal, the time, the
reason. The kill goes to the parent only: it is found as ``getppid()`` (a pid stops being
the parent the moment that process exits, so it is never a reused pid), pinned with a
``pidfd`` before the check, and its start time must match the one the rank passed at spawn.

Standard library only, run by path with ``python -I -S``: it imports nothing of the
package (nor torch), starts in milliseconds and holds none of the rank's descriptors.
A rank in uninterruptible sleep (``D``) takes the SIGKILL only when the kernel lets it go.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "DECISION",
    "REAPED",
    "STOPPED_NOTE",
    "ProcState",
    "Reaper",
    "proc_state",
    "reaped_path",
    "spawn",
]

DECISION = "decision-{rank}.json"  # an answering rank's culprits (hangs.publish_decision)
STOPPED_NOTE = "stopped-rank-{rank}.json"  # the rank is stopped: no verdict will come
REAPED = "reaped-rank-{rank}.json"  # a kill made by the reaper
VERDICT = "rank-{rank}.json"  # the rank's own verdict (watchdog.py): it could act
RECORDED = "recorded.json"  # rank 0's hang record is on disk (hangs.RECORDED)
NONCE_ENV = "STEADYTRAIN_REAPER_NONCE"  # the run's nonce, from the rank (spawn)
MAX_BYTES = 1 << 20  # a decision file is a few hundred bytes
CLOCK_SKEW_S = 60.0  # a decision older than the rank's start by more is a stale run's

STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk sleep",
    "T": "stopped",
    "t": "tracing stop",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
    "P": "parked",
    "W": "paging",
}
STOPPED = frozenset("Tt")


class ProcState(NamedTuple):
    """A process's state letter and start time (clock ticks since boot), from /proc."""

    state: str
    start: int


def proc_state(pid: int) -> ProcState | None:
    """The state letter and start time (clock ticks since boot) of ``pid``, None when it is
    gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
    # the last ")"; starttime is field 22, the 20th after comm.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return ProcState(fields[0], int(fields[19]))
    except (IndexError, ValueError):
        return None


def reaped_path(hang_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(hang_dir) / REAPED.format(rank=rank)


def _read_json(path: Path, uid: int | None = None) -> Any:
    """A small JSON file's value; None when it is missing, not a regular file, not owned
    by ``uid`` (when given), too large or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
                return None
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _publish(path: Path, obj: dict[str, Any]) -> None:
    """Write ``obj`` as ``path`` atomically (a temporary file renamed onto it).

    The one deliberate copy of ``storage.publish``'s protocol: this process runs with
    ``python -I -S`` and imports nothing of the package (publish.py needs xxhash from
    site-packages, and the package's import would cost the reaper its millisecond start)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Reaper:
    """The loop of one reaper (see the module docstring); ``tick`` is one look, testable
    with any ``parent`` and a ``kill`` stub."""

    def __init__(
        self,
        hang_dir: str | os.PathLike[str],
        *,
        rank: int,
        node: str,
        attempt: int,
        world_size: int,
        parent: int,
        parent_start: int,
        since: float,
        nonce: str = "",
        poll_s: float = 0.25,
        idle_s: float = 1.0,
        record_wait_s: float = 10.0,
        backstop_s: float = 25.0,
        kill: Any = None,
        getppid: Any = os.getppid,
    ) -> None:
        self.dir = Path(hang_dir)
        self.rank, self.node, self.attempt = rank, node, attempt
        self.world_size, self.nonce = world_size, nonce
        self.parent, self.parent_start, self.since = parent, parent_start, since
        self.refused: dict[str, str] = {}  # decision file -> why it is not acted on
        self.poll_s, self.idle_s = poll_s, idle_s
        self.record_wait_s, self.backstop_s = record_wait_s, backstop_s
        self._kill = kill or self._kill_parent
        self._getppid = getppid
        self.decided_at: float | None = None  # monotonic time the first decision was seen
        self.reaped: dict[str, Any] | None = None
        self._seen_dir = False  # the attempt's hang directory exists: some rank fired
        self._noted = False  # stopped-rank-{R}.json published
        self._noted_at = 0.0

    # -- what is true now ------------------------------------------------------------------
    def parent_alive(self) -> bool:
        if self._getppid() != self.parent:
            return False  # it exited: we were handed to init (or a subreaper)
        st = proc_state(self.parent)
        return st is not None and st.start == self.parent_start and st.state not in "ZX"

    def decisions(self) -> list[dict[str, Any]]:
        """This attempt's decisions on disk, made by this job (module docstring); the rest
        are skipped, and each refused file is said once on stderr."""
        out = []
        for path in sorted(self.dir.glob(DECISION.format(rank="*"))):
            d = _read_json(path, os.geteuid())
            why = self._refuse(d, path.name)
            if why is None:
                out.append(d)
            elif why and path.name not in self.refused:
                self.refused[path.name] = why
                print(f"[reaper] rank {self.rank}: {path} refused ({why})", file=sys.stderr)
        return out

    def _refuse(self, d: Any, name: str) -> str | None:
        """Why decision ``d`` (file ``name``) is not acted on, or None; "" for one that is
        simply not this attempt's (a stale run's: said nothing about)."""
        if not isinstance(d, dict):
            return "not a JSON object in a regular file owned by this user"
        if d.get("attempt") != self.attempt:
            return ""
        t = d.get("t")
        if not isinstance(t, (int, float)) or t < self.since - CLOCK_SKEW_S:
            return ""  # a run before this one that had the same attempt number
        if d.get("nonce") != self.nonce:
            return "not this run's: its nonce differs"
        ranks = [d.get("rank"), *_list(d.get("stuck_ranks")), *_list(d.get("missing_ranks"))]
        if not isinstance(d.get("stuck_ranks"), list) or not all(
            type(r) is int and 0 <= r < self.world_size for r in ranks
        ):
            return f"names a rank outside the job's {self.world_size} ranks"
        if name != DECISION.format(rank=d["rank"]):
            return f"rank {d['rank']}'s decision in the file {name}"
        return None

    def reason(self, now: float, state: str, decisions: list[dict[str, Any]]) -> str | None:
        """Why the parent is to be killed now, or None (wait)."""
        if not decisions:
            return None
        if self.decided_at is None:
            self.decided_at = now
        waited = now - self.decided_at
        if waited >= self.backstop_s:
            return "backstop"  # it answered but did not exit: whatever it waits on, ends
        stuck = any(self.rank in d["stuck_ranks"] for d in decisions)
        silent = not (self.dir / VERDICT.format(rank=self.rank)).exists()
        if state not in STOPPED and not (stuck and silent):
            return None  # it can act: its watchdog exits it after the hang record
        rank0_silent = self.rank == 0 or any(0 in d.get("missing_ranks", ()) for d in decisions)
        if rank0_silent or (self.dir / RECORDED).exists() or waited >= self.record_wait_s:
            return "stopped" if state in STOPPED else "no response"
        return None

    # -- acting ----------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> bool:
        """One look; True when the reaper is done (its parent is gone or killed)."""
        now = time.monotonic() if now is None else now
        if not self.parent_alive():
            return True
        if not self._seen_dir:
            self._seen_dir = self.dir.is_dir()
            if not self._seen_dir:
                return False
        st = proc_state(self.parent)
        state = st.state if st is not None else "?"
        if state in STOPPED and not self._noted:
            self._note_stopped(state)
        why = self.reason(now, state, self.decisions())
        return why is not None and self.reap(state, why)

    def _note_stopped(self, state: str) -> None:
        note = {
            "rank": self.rank,
            "node": self.node,
            "pid": self.parent,
            "proc_state": state,
            "t": time.time(),
            "attempt": self.attempt,
            "nonce": self.nonce,
        }
        try:
            _publish(self.dir / STOPPED_NOTE.format(rank=self.rank), note)
            self._noted, self._noted_at = True, time.monotonic()
        except OSError as e:  # the others wait out their grace instead
            print(f"[reaper] rank {self.rank}: {STOPPED_NOTE} not written: {e}", file=sys.stderr)
            self._noted = True

    def on_sigterm(self) -> bool:
        """torchrun stops the workers: a stopped parent cannot act on it. True if killed."""
        st = proc_state(self.parent)
        if st is None or st.state not in STOPPED or not self.parent_alive():
            return False
        return self.reap(st.state, "stopped at SIGTERM")

    def reap(self, state: str, why: str) -> bool:
        if not self._kill(self.parent, self.parent_start):
            return False
        self.reaped = {
            "rank": self.rank,
            "node": self.node,
            "pid": self.parent,
            "proc_state": state,
            "proc_state_name": STATE_NAMES.get(state, "unknown"),
            "signal": "SIGKILL",
            "t": time.time(),
            "attempt": self.attempt,
            "reason": why,
        }
        # Killed first, published second: the restart waits on the kill, not on the file.
        print(
            f"[reaper] rank {self.rank} on {self.node}: pid {self.parent} "
            f"{STATE_NAMES.get(state, state)} ({why}); sent SIGKILL",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _publish(reaped_path(self.dir, self.rank), self.reaped)
        except OSError as e:
            print(f"[reaper] rank {self.rank}: {REAPED} not written: {e}", file=sys.stderr)
        return True

    def _kill_parent(self, pid: int, start: int) -> bool:
        """SIGKILL ``pid`` only if it is still our parent and started at ``start``."""
        fd = None
        with contextlib.suppress(AttributeError, OSError):
            fd = os.pidfd_open(pid)  # pins this very process: a reused pid is another one
        try:
            st = proc_state(pid)
            if self._getppid() != pid or st is None or st.start != start:
                return False
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False
        finally:
            if fd is not None:
                os.close(fd)

    def run(self) -> None:
        while not self.tick():
            # Before a hang: one stat per idle_s; once the directory exists, decisions;
            # with the parent stopped and noted, the decision is a few tens of ms away and
            # a replacement waits on the kill (in-place recovery): look every 20 ms.
            # Bounded: the others decide within their grace (record_wait_s is twice it).
            fast = self._noted and time.monotonic() - self._noted_at < self.record_wait_s
            time.sleep(
                min(self.poll_s, 0.02) if fast else self.poll_s if self._seen_dir else self.idle_s
            )


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [None]


def spawn(
    hang_dir: str | os.PathLike[str],
    *,
    rank: int,
    node: str,
    attempt: int,
    world_size: int,
    nonce: str = "",
    poll_s: float,
    idle_s: float,
    record_wait_s: float,
    backstop_s: float,
) -> subprocess.Popen[bytes] | None:
    """Start this process's reaper; None where there is no ``/proc`` or no interpreter.
    ``nonce`` (the run's) goes to it in its environment, which only this user can read in
    ``/proc``; a command line every local user can read."""
    me = proc_state(os.getpid())
    if me is None or not sys.executable:
        return None
    cmd = [
        sys.executable,
        "-I",  # no PYTHON* variables, user site or script directory on sys.path
        "-S",  # no site-packages: the standard library is all it needs
        os.path.abspath(__file__),
        f"--dir={os.fspath(hang_dir)}",
        f"--rank={rank}",
        f"--node={node}",
        f"--attempt={attempt}",
        f"--world={world_size}",
        f"--parent={os.getpid()}",
        f"--parent-start={me.start}",
        f"--since={time.time()}",
        f"--poll={poll_s}",
        f"--idle={idle_s}",
        f"--record-wait={record_wait_s}",
        f"--backstop={backstop_s}",
    ]
    # Same process group as the rank: torchrun's killpg reaches it too. stderr is the
    # rank's (its one line per kill belongs in the job log); no other descriptor is kept.
    env = {**os.environ, NONCE_ENV: nonce}
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)


def main(argv: list[str] | None = None) -> int:
    # Handlers first: a SIGTERM during start-up is remembered, not fatal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank; we follow it
    reaper: Reaper | None = None
    pending = False

    def _term(_sig: int, _frame: Any) -> None:
        nonlocal pending
        pending = reaper is None
        if reaper is not None and reaper.on_sigterm():
            sys.exit(0)

    signal.signal(signal.SIGTERM, _term)  # never die of it: the parent may still need us
    p = argparse.ArgumentParser(prog="steadytrain-reaper")
    p.add_argument("--dir", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--parent-start", type=int, required=True)
    p.add_argument("--since", type=float, required=True)
    p.add_argument("--poll", type=float, default=0.25)
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--record-wait", type=float, default=10.0)
    p.add_argument("--backstop", type=float, default=25.0)
    a = p.parse_args(argv)
    reaper = Reaper(
        a.dir,
        rank=a.rank,
        node=a.node,
        attempt=a.attempt,
        world_size=a.world,
        nonce=os.environ.get(NONCE_ENV, ""),
        parent=a.parent,
        parent_start=a.parent_start,
        since=a.since,
        poll_s=a.poll,
        idle_s=a.idle,
        record_wait_s=a.record_wait,
        backstop_s=a.backstop,
    )
    if pending and reaper.on_sigterm():
        return 0
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        reaper.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
