"""The in-place tests' keeper, forked from a warm process (``warm_pool.keeper``).

    torchrun ... -m steadytrain.warm.enter keeper_entry.py WORKER.py ARGS...

does what ``torchrun ... -m steadytrain.inplace.keeper WORKER.py ARGS...`` does: it runs the
product's keeper (``keeper.main``), which forks the training process and replaces it in
place. Its top-level imports are the keeper's preload and the workers' imports, so the
warm process imports them once and every keeper (each rank, run and attempt) is a fork that
imports nothing; a fresh keeper imports torch and steadytrain (~3-4 s of CPU here), which
was most of the in-place tests' CPU. The keeper as torchrun starts it, a fresh interpreter,
stays under test in ``tests/e2e/test_demo_cli.py`` (the demo's ranks run under it) and
``tests/unit/test_inplace.py``.
"""

import sys

import torch  # noqa: F401
import torch.distributed  # noqa: F401
from torch.distributed.fsdp import fully_shard  # noqa: F401
from torch.nn.parallel import DistributedDataParallel  # noqa: F401

import steadytrain.inplace.recovery  # noqa: F401
from steadytrain.inplace import keeper
from steadytrain.monitor.watchdog import HangWatchdog  # noqa: F401
from steadytrain.run import Run  # noqa: F401

if __name__ == "__main__":
    keeper.main(sys.argv[1:])
