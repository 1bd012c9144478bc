"""The file the keeper runs for ``steadytrain train`` under in-place recovery::

    torchrun ... -m steadytrain.inplace.keeper "$(python -c 'import steadytrain.inplace.train_entry
    as e; print(e.__file__)')" train CONFIG --set recovery.inplace=true

It is the CLI, with what a training process imports lazily named at the top level, so the
keeper imports it once before it forks and a replacement starts without paying it again
(measured in ``steadytrain demo``: the training modules ~1.3 s, MLflow and its SQLite store
1.4 s on this machine). MLflow is optional: the keeper tolerates a failed preload, and so does this file.
"""

import sys

import steadytrain.train.loop  # noqa: F401 - preloaded by the keeper
from steadytrain.cli import main

try:
    import mlflow  # noqa: F401 - the ledger's default sink; preloaded by the keeper
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - its SQLite store (and
    # SQLAlchemy, Alembic), which MlflowClient imports when the sink opens: without it a
    # replaced rank 0 still imported 0.8 s of it in the sink's thread, its GIL slowing the
    # first steps after the regroup (the demo's first-step excess: 0.3 s -> 0.05 s)
except ImportError:
    pass

if __name__ == "__main__":
    sys.exit(main())
