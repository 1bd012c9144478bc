"""steadytrain inside the trainers users already run: callbacks that bring the goodput
ledger, the hang watchdog, crash and restart accounting and ``steadytrain report`` to a
trainer that keeps its own loop and its own checkpointing.

- ``steadytrain.integrations.hf``: ``SteadytrainCallback`` for Hugging Face ``Trainer``;
- ``steadytrain.integrations.lightning``: ``SteadytrainCallback`` for Lightning's ``Trainer``.

Each lives in its own module and imports its trainer only there, so importing this package
costs nothing (docs/training.md, "Inside HF Trainer / Lightning").
"""
