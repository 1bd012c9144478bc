"""A restart that admitted a node: torchelastic's agent at work, not a fault.

An elastic job (``--nnodes MIN:MAX``) whose rendezvous closed without a node (a node whose
rank timed out later than the others, after a partition or a hang; a spare that arrived
late) runs on fewer nodes; when that node arrives, every agent stops its workers with
SIGTERM and the next attempt runs on all of the stopped attempt's nodes and more. The
steps that smaller attempt took past its restore point are redone: a cost of whatever made
the job shrink, so it goes to the previous attempt's incident (``rejoined`` in its
evidence, its ``lost_s``, a clause of its message), and is no ``crash`` of its own. An
attempt stopped by a signal whose next attempt admitted nobody stays what it was (a
preemption that cost steps is a crash). A restart loop (``failures_more.restart_loops``)
looks through such attempts: a hang, a rejoin, the same hang again is one run.
"""

from __future__ import annotations

from typing import Any

from steadytrain.diagnose.failures_attempts import Attempt
from steadytrain.diagnose.failures_cost import cost_words
from steadytrain.diagnose.incident import Incident

__all__ = ["admitted", "fold_rejoin"]


def admitted(a: Attempt, nxt: Attempt | None) -> list[str]:
    """The nodes ``nxt`` added to ``a``'s when it ran on every node of ``a`` and more (by
    the rank files; none known: nothing admitted)."""
    if nxt is None:
        return []
    mine, theirs = set(a.nodes()), set(nxt.nodes())
    if not mine or not mine < theirs or nxt.world <= a.world:
        return []
    return sorted(theirs - mine)


def fold_rejoin(
    inc: Incident, prev: Attempt, a: Attempt, nodes: list[str], cost: dict[str, Any]
) -> None:
    """Charge ``a``'s restart (``cost``: ``restart_cost(a, next)``), which admitted
    ``nodes``, to ``inc``: the incident of ``prev``, the attempt before ``a``."""
    back = [n for n in nodes if n in prev.nodes()]
    verb = "rejoined" if back == nodes else "joined"
    names = ", ".join(nodes)
    lost = float(cost.get("lost_s") or 0.0)
    inc.evidence.setdefault("rejoined", []).append(
        {
            "attempt": a.number,
            "nodes": nodes,
            "world": a.world,
            "steps_redone": int(cost.get("steps_redone") or 0),
            "lost_s": lost,
        }
    )
    inc.lost_s = float(inc.lost_s or 0.0) + lost
    inc.message += (
        f"; {names} {verb} later: attempt {a.number} had started without it on "
        f"{a.world} rank(s) and was stopped to admit it, {cost_words(cost)}"
    )
