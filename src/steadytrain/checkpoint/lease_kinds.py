"""What a lease guards, and the words its messages use (the mechanism: ``lease.py``).

``WRITER``: one live writer per checkpoint root (``ROOT/.writer-lease/``, docs/format.md
part D). ``RUN_LEASE``: one live job per run directory (``RUN_DIR/.run-lease/``, taken by
``steadytrain.Run`` at entry: ``run_lease.py``; docs/format.md part I). Their records have
the same fields; only the folder, the ``format`` and the wording differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from steadytrain.errors import CheckpointError, RunDirInUseError, SteadyError

__all__ = ["FORMAT", "LEASE_DIR", "RUN_LEASE", "VERSION", "WRITER", "LeaseKind"]

LEASE_DIR = ".writer-lease"
FORMAT = "steadytrain-writer-lease"
VERSION = 1  # of both kinds' records


@dataclass(frozen=True)
class LeaseKind:
    """What a lease guards and how its messages say it. ``fix`` may name ``{lease}`` (the
    holder's lease file)."""

    dirname: str  # the folder of generations under the root
    format: str  # the records' "format"
    noun: str  # "writer lease"
    title: str  # "checkpoint writer lease"
    place: str  # "checkpoint root"
    harm: str  # why two live holders are refused
    fix: str  # what the refused job's user does
    lost: str  # what a holder that lost the lease does, and what its user should
    error: type[SteadyError] = CheckpointError  # what a refusal raises


WRITER = LeaseKind(
    dirname=LEASE_DIR,
    format=FORMAT,
    noun="writer lease",
    title="checkpoint writer lease",
    place="checkpoint root",
    harm="Two jobs saving into one checkpoint root would mix their checkpoints.",
    fix="stop that job, or give this job its own checkpoint directory (and remote=)",
    lost="Two jobs are writing checkpoints into one root, so this job stops saving: stop one "
    "of them, or give each job its own checkpoint directory (and remote=)",
)
RUN_LEASE = LeaseKind(
    dirname=".run-lease",
    format="steadytrain-run-lease",
    noun="run lease",
    title="run directory lease",
    place="run directory",
    harm="Two jobs in one run directory would restore the same checkpoint, write one ledger "
    "and one set of rank files, and the report would invent crashes and time.",
    fix="stop that job, or give this job its own run_dir; if you know that job is dead, "
    "delete {lease}",
    lost="Two jobs are recording into one run directory; this job goes on training: stop one "
    "of them, or give each its own run_dir",
    error=RunDirInUseError,
)
