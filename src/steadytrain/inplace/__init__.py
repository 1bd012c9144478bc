"""In-place recovery of a process fault (issue 44 section 2; the foundation, not yet in ``Run``).

When one rank's process dies and its node lives, the other ranks keep their processes,
their model, optimizer and loader objects: they leave the broken process group, agree on
the point to resume from (the start of the failed step, which they hold live, or a
snapshot every rank holds), and form a new group with the one replaced rank, which is
forked from a process that already imported torch and the script's modules.

- ``keeper``: the process torchrun starts for a rank (``torchrun ... -m
  steadytrain.inplace.keeper SCRIPT ARGS``); it imports once and forks the training process,
  and forks a new one when that process dies of a signal and ``policy`` allows;
- ``slurm``: the keeper under ``srun`` without torchrun: the ranks from ``SLURM_*``, the
  store rank 0's keeper hosts;
- ``policy``: which child deaths are recovered in place, which fall back to torchrun's
  whole restart (pure);
- ``regroup``: leave the broken group, agree on a generation through torchrun's store, join
  a fresh group, agree on the step to resume from (pure ``agree``);
- ``recovery``: ``Recovery``, what a training loop holds (``with recovery.step(step)``,
  the agreement's outcome restored);
- ``live``: the live recovery point (the start of each step: the optimizers' tensors as
  they are, the rest copied; the per-rank states in a bounded set of store keys);
- ``snapshot``: how an opt-in snapshot (``every_steps``) is copied (the optimizers' tensors
  by a background thread that their ``step()`` waits for; a copy is a rollback point only
  once complete).

Docs: docs/operations.md, "In-place recovery (foundation)".
"""

from steadytrain.inplace.recovery import Rebuilt, Recovery
from steadytrain.inplace.regroup import InPlaceFallback

__all__ = ["InPlaceFallback", "Rebuilt", "Recovery"]
