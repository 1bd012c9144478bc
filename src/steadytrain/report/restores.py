"""Restores and memory snapshots in the report: which tier each restart came back from.

Issue 28 keeps recovery points in two tiers: node-local memory (with a copy on a peer node)
and durable storage. A restart's ``restore`` record says which one it read (``tier``:
``local-memory``, ``peer-memory`` or ``durable``; a ledger written before the memory tier
has none, and every restore then was durable), how long it took (``restore_s``) and the bytes
it read locally and from a peer. ``RestoreLog`` reads them in ledger order, beside the
goodput accumulator, and gives the report:

* ``restores``: one row per attempt that restored a step > 0: ``{"attempt", "step", "tier",
  "seconds", "steps_lost", "bytes_local", "bytes_peer", "in_startup"}``. A trainer that
  restores by itself (the HF and Lightning callbacks: ``tier`` ``trainer``) loads before
  the attempt's ``job_start``, so its load is inside ``startup``: ``seconds`` is None and
  ``in_startup`` true, and the table says "in start-up" (it said "durable 0.00 s").
  ``steps_lost`` is the ledger's last step before that attempt minus the restored step
  (>= 0). The "last step" is the
  timeline's position: the newest ``step`` record, or, when an attempt recorded no step, the
  step that attempt restored -- so a failure in a warm-up is not charged the same lost steps
  twice, and the rows sum to the work the restarts threw away in steps.
* ``restores_by_tier``: per tier, ``count``, ``seconds`` (sum) and ``steps_lost`` (sum).
* ``passed_over``: what each attempt's restore passed over and why, from the record's
  ``skipped`` list (a memory snapshot of another run or of another user, a damaged copy on
  any node, a partial or foreign durable checkpoint): ``{"attempt", "restored_step",
  "step", "path", "node", "reason"}``, fresh starts included (a run that reused a run
  directory restores nothing, and this says what it did not restore). Bounded: at most
  ``PASSED_PER_RESTORE`` entries per restore and ``PASSED_MAX`` in all, the rest counted
  (``passed_over_more``).
* ``memory_snapshots``: the memory tier's cost, from its ``memory_snapshot`` records.

Where a snapshot's blocking is in the goodput breakdown: the Checkpointer returns the
seconds the loop was blocked from ``maybe_save`` -- the durable save's and the memory
snapshot's together (issue 28's contract: a snapshot blocks for staging, plus waiting for
the previous generation) -- and the loop records that as the step's ``checkpoint_block_s``. So
the snapshots' ``block_s`` is already inside the ``checkpoint_block`` bucket: adding it
again would count it twice. ``memory_snapshots.block_s`` says how much of that bucket the
memory tier took (``share_of_checkpoint_block``); the breakdown itself is not changed here.
The background write and peer transfer (``write_s``, ``peer_s``) do not block the loop;
what they cost the steps beside them would show as ``slowdown`` only for durable writes
(``monitor/slowdown.py`` follows ``checkpoint`` records), so they are shown, not charged.
"""

from __future__ import annotations

import math
from typing import Any

from steadytrain.printable import html_text, printable

__all__ = [
    "TIERS",
    "PASSED_MAX",
    "PASSED_PER_RESTORE",
    "RestoreLog",
    "restore_lines",
    "restores_html",
]

TIERS = ("local-memory", "peer-memory", "durable")
# A trainer's own restore (integrations/hooks.py TrainerSaves): timed inside start-up.
IN_STARTUP_TIER = "trainer"
PASSED_PER_RESTORE = 20  # entries of one restore's ``skipped`` the report keeps
PASSED_MAX = 200  # and of the whole run
_TEXT_MAX = 400  # characters of a reason or path (records are untrusted input)


def _int(v: Any) -> int:
    """A step from a checked record (records.py): a non-negative integer, else 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0
    return int(v) if math.isfinite(v) and v >= 0 else 0


def _text(v: Any) -> str:
    """Untrusted text for a terminal or a page: bounded, control characters escaped."""
    return printable(str(v)[:_TEXT_MAX])


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


class RestoreLog:
    """Feed every ledger record in order (``add``); read ``rows()``, ``by_tier()`` and
    ``snapshots()`` at the end. Memory: one row per restart, never per step."""

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._position = 0  # the timeline's newest step (see the module docstring)
        self._open: dict[str, Any] | None = None  # the newest attempt, until its row is made
        self._pending: dict[str, Any] | None = None  # a restore seen before its job_start
        self._starts = 0
        self._passed: list[dict[str, Any]] = []  # passed_over, of the closed attempts
        self._passed_more = 0  # entries left out by the bounds
        self._snap = {
            "count": 0,
            "ok": 0,
            "failed": 0,
            "block_s": 0.0,
            "write_s": 0.0,
            "peer_s": 0.0,
            "bytes": 0,
            "peer_bytes": 0,
            "last_step": None,
            "last_error": None,
        }

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "job_start":
            self._close()
            restored = _int(rec.get("restored_step"))
            attempt = rec.get("attempt")
            self._open = {
                "attempt": attempt if isinstance(attempt, int) else self._starts,
                "job_start": rec,
                "restore": self._pending,
                "before": self._position,
                "stepped": False,
            }
            self._pending = None
            self._starts += 1
            self._position = restored  # this attempt's timeline starts at its restore point
        elif kind == "restore":
            # Recorded after its attempt's job_start (steadytrain.Run holds it until then); a
            # hand-written loop may record it before: it then belongs to the next attempt.
            o = self._open
            if o is not None and o["restore"] is None and not o["stepped"]:
                o["restore"] = rec
            else:
                self._pending = rec
        elif kind == "step":
            self._position = _int(rec.get("step"))
            if self._open is not None:
                self._open["stepped"] = True
        elif kind == "memory_snapshot":
            self._snapshot(rec)

    def _snapshot(self, rec: dict[str, Any]) -> None:
        s = self._snap
        s["count"] += 1
        # Blocked is blocked, refused or not: every record's block_s counts.
        s["block_s"] += _num(rec.get("block_s")) or 0.0
        if rec.get("ok", True) is False:
            s["failed"] += 1
            if isinstance(rec.get("error"), str):
                s["last_error"] = rec["error"]
            return
        s["ok"] += 1
        s["write_s"] += _num(rec.get("write_s")) or 0.0
        s["peer_s"] += _num(rec.get("peer_s")) or 0.0
        s["bytes"] += int(_num(rec.get("bytes")) or 0)
        s["peer_bytes"] += int(_num(rec.get("peer_bytes")) or 0)
        s["last_step"] = _int(rec.get("step"))

    def _close(self) -> None:
        o, self._open = self._open, None
        row = self._row(o) if o is not None else None
        if row is not None:
            self._rows.append(row)
        if o is not None:
            self._passed, self._passed_more = self._with(o)

    def _with(self, o: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """``passed_over`` and the count left out, with attempt ``o``'s restore added."""
        kept, more = self._passed_of(o)
        room = max(0, PASSED_MAX - len(self._passed))
        return self._passed + kept[:room], self._passed_more + more + max(0, len(kept) - room)

    @staticmethod
    def _passed_of(o: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """Attempt ``o``'s restore's well-formed ``skipped`` entries, at most
        ``PASSED_PER_RESTORE``, and how many more there were."""
        rest = o["restore"] or {}
        skipped = rest.get("skipped")
        if not isinstance(skipped, list):
            return [], 0
        good = [s for s in skipped if isinstance(s, dict) and isinstance(s.get("reason"), str)]
        out = []
        for s in good[:PASSED_PER_RESTORE]:
            node = s.get("node")
            out.append(
                {
                    "attempt": o["attempt"],
                    "restored_step": _int(rest.get("step")),
                    "step": _int(s.get("step")),
                    "path": _text(s.get("path", "")),
                    "node": _text(node) if isinstance(node, str) else None,
                    "reason": _text(s["reason"]),
                }
            )
        return out, len(good) - len(out)

    @staticmethod
    def _row(o: dict[str, Any]) -> dict[str, Any] | None:
        """The ``restores`` row of attempt ``o``, or None when it restored nothing."""
        start, rest = o["job_start"], o["restore"] or {}
        step = _int(rest.get("step")) if "step" in rest else _int(start.get("restored_step"))
        if step <= 0:
            return None  # a fresh start: nothing was restored
        tier = rest.get("tier")
        # An older ledger's restore (or none at all) was durable: the only tier then.
        tier = tier if isinstance(tier, str) and tier else "durable"
        in_startup = tier == IN_STARTUP_TIER
        seconds = _num(rest.get("restore_s"))
        if seconds is None:
            seconds = _num(start.get("restore_s")) or 0.0
        return {
            "attempt": o["attempt"],
            "step": step,
            "tier": tier,
            "seconds": None if in_startup else seconds,  # not timed apart from start-up
            "steps_lost": max(0, o["before"] - step),
            "bytes_local": _num(rest.get("bytes_local")),
            "bytes_peer": _num(rest.get("bytes_peer")),
            "in_startup": in_startup,
        }

    def rows(self) -> list[dict[str, Any]]:
        """The ``restores`` rows, the newest attempt's included (rows are made when the
        next attempt starts; the open one's is made here, without closing it)."""
        last = self._row(self._open) if self._open is not None else None
        return [*self._rows, *([last] if last is not None else [])]

    def passed_over(self) -> tuple[list[dict[str, Any]], int]:
        """The ``passed_over`` entries, the newest attempt's included, and how many the
        bounds left out (module docstring)."""
        if self._open is None:
            return list(self._passed), self._passed_more
        return self._with(self._open)

    def by_tier(self) -> dict[str, dict[str, Any]]:
        """``{tier: {"count", "seconds", "steps_lost"}}`` for every tier seen (the three
        known ones always, zero ones too, so a reader can tell "none" from "unknown")."""
        out: dict[str, dict[str, Any]] = {
            t: {"count": 0, "seconds": 0.0, "steps_lost": 0} for t in TIERS
        }
        for r in self.rows():
            e = out.setdefault(r["tier"], {"count": 0, "seconds": 0.0, "steps_lost": 0})
            e["count"] += 1
            e["seconds"] += r["seconds"] or 0.0
            e["steps_lost"] += r["steps_lost"]
        return out

    def snapshots(self, checkpoint_block_s: float) -> dict[str, Any]:
        """The memory tier's cost. ``block_s`` is part of ``checkpoint_block_s`` (the
        bucket), not added to it (module docstring); ``share_of_checkpoint_block`` says how
        much of it (None when the bucket is empty)."""
        s = dict(self._snap)
        s["in_checkpoint_block"] = True
        s["share_of_checkpoint_block"] = (
            min(1.0, s["block_s"] / checkpoint_block_s) if checkpoint_block_s > 0 else None
        )
        return s


def restore_lines(summary: dict[str, Any]) -> list[str]:
    """The text report's "Restores" table and the memory tier's cost, one line each."""
    out: list[str] = []
    rows = summary.get("restores") or []
    passed = summary.get("restores_passed_over") or []
    if rows or passed:
        out.append("Restores:")
    if rows:
        out.append(
            f"  {'attempt':>7}  {'step':>8}  {'tier':<13} {'seconds':>8}  {'steps lost':>10}"
        )
        for r in rows:
            out.append(
                f"  {r['attempt']!s:>7}  {r['step']:>8}  {r['tier']:<13} "
                f"{_seconds(r):>8}  {r['steps_lost']:>10}"
            )
        if any(r.get("in_startup") for r in rows):
            out.append(f"  {IN_STARTUP_NOTE}")
    if passed:
        out.append("  passed over at restore (not restored, and why):")
        out += [f"    {_passed_line(p)}" for p in passed]
        more = summary.get("restores_passed_over_more") or 0
        if more:
            out.append(f"    ... and {more} more (the ledger's restore records list them)")
    snap = summary.get("memory_snapshots") or {}
    if snap.get("count"):
        share = snap.get("share_of_checkpoint_block")
        out.append(
            f"memory snapshots: {snap['ok']} ok, {snap['failed']} refused or failed; "
            f"blocking {snap['block_s']:.2f} s"
            + (f" ({share:.0%} of checkpoint_block, counted there)" if share is not None else "")
            + f", background write {snap['write_s']:.2f} s, peer {snap['peer_s']:.2f} s, "
            f"{snap['bytes']} bytes own, {snap['peer_bytes']} bytes to peers"
        )
        if snap.get("last_error"):
            out.append(f"  memory tier: {snap['last_error']}")
    return out


IN_STARTUP_NOTE = (
    "in start-up: the trainer loaded its own checkpoint before the attempt's first record, "
    "so the load is inside the startup bucket"
)


def _seconds(row: dict[str, Any]) -> str:
    """A row's restore time as the tables print it: "in start-up" for a trainer's own."""
    return "in start-up" if row.get("in_startup") else f"{row['seconds']:.2f}"


def _passed_line(p: dict[str, Any]) -> str:
    """One passed-over entry: which attempt, what (on which node), why."""
    where = f"{p['node']}:{p['path']}" if p.get("node") else p["path"]
    step = f"step {p['step']}, " if p.get("step") else ""
    return f"attempt {p['attempt']}: {step}{where}: {p['reason']}"


def restores_html(summary: dict[str, Any]) -> str:
    """The HTML page's "Restores" section ("" when nothing was restored or snapshotted)."""
    e = html_text  # tiers and errors come from the ledger
    rows = summary.get("restores") or []
    part = ""
    if rows:
        body = "".join(
            f"<tr><td>{e(r['attempt'])}</td><td>{e(r['step'])}</td><td>{e(r['tier'])}</td>"
            f"<td>{_seconds(r)}{'' if r.get('in_startup') else ' s'}</td>"
            f"<td>{r['steps_lost']}</td></tr>"
            for r in rows
        )
        note = f"<p>{e(IN_STARTUP_NOTE)}</p>" if any(r.get("in_startup") for r in rows) else ""
        part = (
            '<h2>Restores</h2><table class="restores"><tr><th>attempt</th><th>step</th>'
            f"<th>tier</th><th>seconds</th><th>steps lost</th></tr>{body}</table>{note}"
        )
    passed = summary.get("restores_passed_over") or []
    if passed:
        items = "".join(f"<li>{e(_passed_line(p))}</li>" for p in passed)
        part += (
            "" if rows else "<h2>Restores</h2>"
        ) + f"<p>Passed over at restore (not restored, and why):</p><ul>{items}</ul>"
    lines = restore_lines({"memory_snapshots": summary.get("memory_snapshots")})
    return part + "".join(f"<p>{e(ln)}</p>" for ln in lines)
