"""Crashes the trainer examples inject for their tests: a SIGKILL in the middle of a save.

A mid-step crash needs no help (a callback kills its process at a step's start). A crash in
the middle of a save does: the write runs in the checkpointer's background thread and a
tiny model's save is over in milliseconds, so a kill timed from the training loop lands
before or after it at random. ``kill_before_commit`` puts the kill inside the save itself:
rank 0's writer thread calls the checkpointer's ``before_commit`` once every rank's shards
are written and before COMMIT (here, once the ledger holds the step, as ``before_commit``
makes sure), so the process dies with the checkpoint's data on disk and no COMMIT, while the
training loop is already in the next step. Only on the job's first
attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted job finishes.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

__all__ = ["first_attempt", "kill_before_commit"]


def first_attempt() -> bool:
    """This process belongs to the job's first attempt under torchrun (or no torchrun)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def kill_before_commit(checkpointer: Any, step: int) -> None:
    """SIGKILL this process when ``checkpointer`` (a ``Checkpointer`` whose rank writes
    COMMIT: rank 0) is about to commit ``step``, on the first attempt only."""
    if not first_attempt():
        return
    commit = checkpointer.before_commit
    # an async save of step s waits for the ledger through s, a sync one through s - 1
    through_step = step - 1 if checkpointer.async_mode == "sync" else step

    def before_commit(through: int) -> Any:
        done = commit(through) if commit is not None else True  # the ledger holds the step
        if through == through_step:
            print(f"[fault] killed while checkpoint {step} was saved", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    checkpointer.before_commit = before_commit
