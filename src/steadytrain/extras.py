"""Optional dependencies: import one, or say which extra to install.

The core install (``pip install steadytrain``) is enough for the loader, the checkpointer,
tokenize on text and JSON Lines, and the ledger. Heavier parts are extras: ``[s3]``
(s3fs/boto3), ``[parquet]`` (pyarrow), ``[zstd]`` (zstandard, for ``.jsonl.zst`` inputs),
``[mlflow]`` (mlflow-skinny + SQLite store), ``[report]`` (matplotlib), ``[all]``. Using a part whose extra is missing raises
``ConfigError`` naming the ``pip install`` line, not a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from steadytrain.errors import ConfigError

__all__ = ["require", "missing_extra"]

# The extra that brings each optional top-level module.
EXTRA_OF = {
    "s3fs": "s3",
    "boto3": "s3",
    "pyarrow": "parquet",
    "zstandard": "zstd",
    "mlflow": "mlflow",
    "sqlalchemy": "mlflow",
    "alembic": "mlflow",
    "matplotlib": "report",
}


def missing_extra(module: str, purpose: str) -> ConfigError:
    """The error for a missing optional module (``module`` is its import name)."""
    extra = EXTRA_OF.get(module.split(".", 1)[0], "all")
    return ConfigError(
        f"{purpose} needs the optional package {module.split('.', 1)[0]!r}, which is not "
        f"installed; install it with: pip install 'steadytrain[{extra}]'"
    )


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or ``missing_extra`` if it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name.split(".", 1)[0]):
            raise missing_extra(module, purpose) from exc
        raise
