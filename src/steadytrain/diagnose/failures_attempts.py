"""The failure detectors' view of a run: one ``Attempt`` per ``job_start``, and its words.

``attempts(rec)`` lines up, per attempt, what rank 0's ledger says (its start, restore
point, steps, events, ``job_end``) with what every rank's own file says about that attempt
(node, host addresses, last step, ``rank_end``, first steps' reads: the per-attempt facts
``RankSummary`` keeps in its ``attempts`` entries). ``Words`` turns the reasons ranks wrote
(a gloo error naming a peer by IP address) into text an engineer can act on: the address
replaced by the node that had it (from ``rank_start``'s ``addrs``), else by "a peer",
secrets redacted, one bounded line.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from steadytrain.diagnose.inputs import RunRecords
from steadytrain.redact import redact_text

__all__ = [
    "CLEAN_REASONS",
    "Attempt",
    "Words",
    "attempts",
    "clean_entry",
    "clean_hang",
    "is_peer_error",
]

# job_end reasons of a clean end (run_support.CLEAN_REASONS; not imported: that module
# imports torch, and diagnosis must run where torch is not installed).
CLEAN_REASONS = ("finished", "interpreter_exit")
MAX_REASON = 240  # characters of a reason kept in a message

# An IPv4 address (optionally bracketed, with a port) or a bracketed IPv6 one, as gloo and
# NCCL print a peer: "Connection closed by peer [10.0.0.2]:31448".
_IP = re.compile(
    r"\[?(?<![\w.])(?P<v4>(?:\d{1,3}\.){3}\d{1,3})(?![\w.])\]?(?::\d{1,5})?"
    r"|\[(?P<v6>[0-9A-Fa-f]*:[0-9A-Fa-f:.]*)(?:%\w+)?\](?::\d{1,5})?"
)
# A C++ source location gloo prefixes to its errors ("[/__w/.../pair.cc:553] ").
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp|c):\d+\]\s*")
# The error of a rank whose collective lost its peer: the fault is elsewhere.
_PEER = re.compile(
    r"closed by peer|reset by peer|connection (?:reset|refused|closed)|broken pipe|"
    r"remote (?:worker|process|peer)|peer .*(?:gone|closed|died)|NCCL communicator was aborted|"
    r"ProcessGroup\w* .*(?:aborted|shut ?down)|checkpoint group failed|"
    r"(?:socket|collective|operation|wait\w*) (?:has )?timed? ?out|Timed out",
    re.IGNORECASE,
)


def is_peer_error(reason: str | None) -> bool:
    """A reason that says a peer (or the collective with it) failed, not this rank."""
    return bool(reason) and bool(_PEER.search(str(reason)))


@dataclass
class Attempt:
    """One attempt as the failure detectors read it."""

    index: int  # in ledger order (StepColumns.attempt, RunRecords.ends())
    number: int  # its job_start's ``attempt`` (rank files, hangs/attempt-N)
    start: dict[str, Any]
    end: dict[str, Any] | None
    events: list[dict[str, Any]]  # ledger records between this job_start and the next
    restored_step: int
    world: int
    first_step: int | None = None  # rank 0's ledger
    last_step: int | None = None  # the furthest any record of this attempt got
    last_t: float | None = None  # when that step was recorded
    first_t: float | None = None
    step_s: float | None = None  # median step time of this attempt
    # rank -> its rank file's entry for this attempt ("node", "addrs", "pid", "end",
    # "last_step", "last_t", "steps", "early_cache_misses", ...)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    hang: dict[str, Any] | None = None  # the ledger's hang record for this attempt

    @property
    def began(self) -> float:
        """When its processes started (job_start is written after start-up and restore)."""
        s = self.start
        return float(s["t"]) - float(s.get("startup_s") or 0) - float(s.get("restore_s") or 0)

    @property
    def reason(self) -> str | None:
        return None if self.end is None else str(self.end.get("reason") or "")

    @property
    def clean(self) -> bool:
        return self.end is not None and self.reason in CLEAN_REASONS

    def nodes(self) -> dict[str, list[int]]:
        """node -> its ranks in this attempt."""
        out: dict[str, list[int]] = {}
        for r, e in sorted(self.ranks.items()):
            if e.get("node"):
                out.setdefault(str(e["node"]), []).append(r)
        return out

    def node_of(self, rank: int) -> str | None:
        e = self.ranks.get(rank)
        return None if e is None or not e.get("node") else str(e["node"])


def _int(v: Any) -> int | None:
    """``v`` as a step or rank, None when it is not one (records are read, not trusted)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        return None
    return int(v) if v < 2**53 else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
        return None
    return float(v)


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


_ENTRY_INTS = ("attempt", "steps", "first_step", "last_step", "early_steps")
_ENTRY_NUMS = ("t", "last_t", "bytes_read", "cache_hits", "cache_misses", "early_bytes_read",
               "early_cache_hits", "early_cache_misses")  # fmt: skip


def clean_entry(e: dict[str, Any]) -> dict[str, Any]:
    """A rank file's ``attempts`` entry with every field of the type the detectors read
    (a snapshot is a file: a wrong type becomes None, never an exception)."""
    out: dict[str, Any] = dict(e)
    for k in _ENTRY_INTS:
        out[k] = _int(e.get(k))
    for k in _ENTRY_NUMS:
        out[k] = _num(e.get(k))
    out["node"] = _str(e.get("node"))
    addrs = e.get("addrs")
    out["addrs"] = [a for a in addrs if isinstance(a, str)] if isinstance(addrs, list) else []
    end = e.get("end")
    out["end"] = (
        {"reason": _str(end.get("reason")) or "", "step": _int(end.get("step")),
         "t": _num(end.get("t"))}
        if isinstance(end, dict) else None
    )  # fmt: skip
    return out


def clean_hang(h: dict[str, Any]) -> dict[str, Any]:
    """A ledger ``hang`` record with the types the detectors read."""
    stuck = []
    for e in h.get("stuck") if isinstance(h.get("stuck"), list) else []:
        if isinstance(e, dict) and _int(e.get("rank")) is not None:
            stuck.append({"rank": _int(e["rank"]), "node": _str(e.get("node")),
                          "frame": _str(e.get("frame")), "state": _str(e.get("state"))})  # fmt: skip
    ranks = h.get("stuck_ranks")
    return {
        "type": "hang",
        "attempt": _int(h.get("attempt")),
        "step": _int(h.get("step")),
        "stuck_ranks": [r for r in map(_int, ranks) if r is not None]
        if isinstance(ranks, list)
        else [],
        "stuck": stuck,
        **{k: _str(h.get(k)) for k in ("phase", "frame", "cause", "dump_dir")},
        **{k: _num(h.get(k)) for k in ("t", "progress_t", "detect_t", "deadline_s")},
    }


def _median(xs: list[float]) -> float | None:
    # NaN: a record without the field; 0: a step recovered after a SIGKILL (no timing)
    xs = [x for x in xs if x == x and x > 0]
    return statistics.median(xs) if xs else None


def attempts(rec: RunRecords) -> list[Attempt]:
    """Every attempt of the run, oldest first."""
    out: list[Attempt] = []
    events: list[list[dict[str, Any]]] = []
    for e in rec.events:
        if e.get("type") == "job_start":
            events.append([])
        elif events:
            events[-1].append(e)
    ends = rec.ends()
    for i, start in enumerate(rec.starts):
        out.append(
            Attempt(
                index=i,
                number=int(start.get("attempt", i)),
                start=start,
                end=ends.get(i),
                events=events[i] if i < len(events) else [],
                restored_step=int(start.get("restored_step") or 0),
                world=int(start.get("world_size") or 1),
            )
        )
    by_index = {a.index: a for a in out}
    durations: dict[int, list[float]] = {}
    s = rec.steps
    for a_i, step, t, dur in zip(s.attempt, s.step, s.t, s.step_s, strict=True):
        a = by_index.get(a_i)
        if a is None:
            continue
        a.first_step = step if a.first_step is None else min(a.first_step, step)
        if a.last_step is None or step >= a.last_step:
            a.last_step, a.last_t = step, t
        a.first_t = t if a.first_t is None else min(a.first_t, t)
        durations.setdefault(a_i, []).append(dur)
    by_number = {a.number: a for a in out}
    for rank, summary in rec.view.ranks.items():
        for entry in summary.attempts:
            a = by_number.get(entry.get("attempt"))  # type: ignore[arg-type]
            if a is not None and isinstance(entry, dict):
                a.ranks[rank] = clean_entry(entry)
    for a in out:
        a.step_s = _median(durations.get(a.index, []))
        # A rank may have recorded a step rank 0 did not (rank 0 died first).
        for e in a.ranks.values():
            ls = e.get("last_step")
            if ls is not None and (a.last_step is None or ls > a.last_step):
                a.last_step = ls
                a.last_t = e.get("last_t") if e.get("last_t") is not None else a.last_t
    for e in rec.events:  # a recovered record is written in a later attempt: by number
        if e.get("type") == "hang" and e.get("attempt") in by_number:
            a = by_number[e["attempt"]]
            a.hang = a.hang or clean_hang(e)
    return out


class Words:
    """Reasons as text an engineer can act on: IP addresses named by node, secrets out."""

    def __init__(self, rec: RunRecords) -> None:
        owners: dict[str, set[str]] = {}
        for summary in rec.view.ranks.values():
            for entry in summary.attempts:
                node = entry.get("node")
                addrs = entry.get("addrs")
                if not node or not isinstance(addrs, list):
                    continue
                for addr in addrs:
                    if isinstance(addr, str):
                        owners.setdefault(addr, set()).add(str(node))
        # An address several nodes have (a container bridge's 172.17.0.1) names none.
        self.addr_node = {a: next(iter(n)) for a, n in owners.items() if len(n) == 1}

    def _ip(self, m: re.Match[str]) -> str:
        addr = m.group("v4") or m.group("v6")
        return self.addr_node.get(addr, "a peer")

    def peers(self, text: str | None) -> list[str]:
        """The nodes whose addresses ``text`` names (unknown addresses left out)."""
        out: list[str] = []
        for m in _IP.finditer(text or ""):
            node = self.addr_node.get(m.group("v4") or m.group("v6"))
            if node and node not in out:
                out.append(node)
        return out

    def line(self, text: str | None, limit: int = MAX_REASON) -> str:
        """``text`` as one line: no IP address (its node, else "a peer"), no C++ source
        location, secrets redacted, at most ``limit`` characters."""
        if not text:
            return ""
        t = _SOURCE.sub("", str(text))
        t = _IP.sub(self._ip, t)
        t = t.replace("peer a peer", "a peer")  # "closed by peer [addr]" -> "by a peer"
        t = redact_text(" ".join(t.split()))
        # gloo's advice and sign-off after the first sentences add nothing to a report
        cut = t.find(" Check the logs")
        if cut > 0:
            t = t[:cut]
        return t if len(t) <= limit else t[: limit - 1] + "…"

    def first_line(self, text: str | None, limit: int = MAX_REASON) -> str:
        """The first non-empty line of ``text`` (an error with a traceback), as ``line``."""
        for ln in str(text or "").splitlines():
            if ln.strip():
                return self.line(ln, limit)
        return ""
