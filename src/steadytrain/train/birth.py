"""When this process was born: moved to ``steadytrain.run_birth`` (the public entry's
start-up accounting, ``steadytrain.Run``); re-exported here for older imports."""

from __future__ import annotations

from steadytrain.run_birth import process_start

__all__ = ["process_start"]
