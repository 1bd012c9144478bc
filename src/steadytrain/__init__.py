"""steadytrain: keep GPUs doing useful work during long PyTorch pretraining runs.

The public names are imported lazily so that ``import steadytrain`` (and the CLI's
``--help``) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TokenDataset": "steadytrain.data.read.dataset",
    "DatasetWriter": "steadytrain.data.ingest.writer",
    "TokenLoader": "steadytrain.data.read.loader",
    "TokenIterableDataset": "steadytrain.data.read.faces",
    "TokenWindows": "steadytrain.data.read.faces",
    "ShardCache": "steadytrain.storage.cache",
    "Store": "steadytrain.storage.store",
    "Checkpointer": "steadytrain.checkpoint.checkpointer",
    "GoodputMeter": "steadytrain.monitor.meter",
    "Run": "steadytrain.run",
    "exact_ddp": "steadytrain.ddp",
    "SteadyError": "steadytrain.errors",
    "DatasetError": "steadytrain.errors",
    "StorageError": "steadytrain.errors",
    "CheckpointError": "steadytrain.errors",
    "ConfigError": "steadytrain.errors",
    "LoaderStateError": "steadytrain.errors",
    "ReadDeadlineError": "steadytrain.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'steadytrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
