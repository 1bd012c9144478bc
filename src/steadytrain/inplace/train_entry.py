"""The file the keeper runs for ``steadytrain train`` under in-place recovery::

    torchrun ... -m steadytrain.inplace.keeper "$(python -c 'import steadytrain.inplace.train_entry
    as e; print(e.__file__)')" train CONFIG --set recovery.inplace=true

It is the CLI, with what a training process imports lazily named at the top level, so the
keeper imports it once before it forks and a replacement starts without paying it again
(measured in ``steadytrain demo``: the training modules ~1.3 s, MLflow ~6 s on this kind of
machine). MLflow is optional: the keeper tolerates a failed preload, and so does this file.
"""

import sys

import steadytrain.train.loop  # noqa: F401 - preloaded by the keeper
from steadytrain.cli import main

try:
    import mlflow  # noqa: F401 - the ledger's default sink; preloaded by the keeper
except ImportError:
    pass

if __name__ == "__main__":
    sys.exit(main())
