"""Error types. Every error a user can cause names the file or value at fault and the fix.

The CLI prints these without a traceback and exits with status 2; anything else is a bug.
"""

from __future__ import annotations

from steadytrain.redact import redact_text

__all__ = [
    "SteadyError",
    "DatasetError",
    "StorageError",
    "CheckpointError",
    "ConfigError",
    "LoaderStateError",
    "ReadDeadlineError",
    "RunDirInUseError",
]


class SteadyError(Exception):
    """Base class: a problem the user can fix. The message says what and how, and never
    shows a credential in a URL (``user:password@``, a signature): every message goes
    through ``steadytrain.redact`` here, so no raise site can forget it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))


class DatasetError(SteadyError):
    """A dataset (manifest, shard, index) is missing, malformed or inconsistent."""


class StorageError(SteadyError):
    """Object storage or the local cache could not be reached, read or written."""


class CheckpointError(SteadyError):
    """A checkpoint could not be written, verified or restored."""


class RunDirInUseError(SteadyError):
    """Another live job holds the run directory (``steadytrain.Run`` refuses at entry)."""


class ConfigError(SteadyError, ValueError):
    """A setting is invalid; raised at construction, before any work starts."""


class LoaderStateError(SteadyError, ValueError):
    """A saved loader state does not match the loader it is being loaded into."""


class ReadDeadlineError(SteadyError, TimeoutError):
    """A read did not finish within its deadline (stuck storage, dead server)."""
