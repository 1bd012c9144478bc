"""Where an export is built before it has its name, and what becomes of it when it stops.

An export is built under a hidden name beside ``DEST``, ``.NAME.tmp-HOST-PID-XXXXXXXX`` (a
checkpoint's size: it must never outlive the export that made it):

- an export that fails, or that is stopped by SIGTERM (a scheduler, ``kill``) or SIGINT
  (Ctrl-C), removes it before it exits (``building``); SIGTERM is turned into an exception
  for that (``run_support.SignalGuard``, only where the handler was the default), and the
  process still exits with status 143 as if killed by it;
- SIGKILL (or a lost machine) leaves it: the next export to the same ``DEST`` removes every
  one left by a process of this host that no longer runs (``sweep``). One of another host
  (``DEST`` on a shared file system) or of a live process is never touched, and neither is
  anything that is not this user's; a symlink in that place is removed as a link, never
  followed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import uuid
from collections.abc import Iterator

from steadytrain.checkpoint.identity import pid_gone
from steadytrain.storage.regular import remove_own

__all__ = ["building", "export_temp_name", "sweep"]

log = logging.getLogger(__name__)


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_") or "localhost"


def export_temp_name(dest: str) -> str:
    """A hidden, unique name beside ``dest`` (same file system: the publish is a rename)
    that says which host and process builds it."""
    directory, base = os.path.split(dest)
    return os.path.join(directory, f".{base}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def sweep(dest: str) -> list[str]:
    """Remove what exports to ``dest`` killed on this host left (module docstring); the
    paths removed. Never fails: what cannot be removed is logged and left."""
    directory, base = os.path.split(dest)
    pattern = re.compile(rf"\.{re.escape(base)}\.tmp-(.+)-(\d+)-[0-9a-f]{{8}}")
    removed = []
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return removed  # no parent yet: nothing was left there
    for name in names:
        m = pattern.fullmatch(name)
        if not m or m.group(1) != _host() or not pid_gone(int(m.group(2)), None):
            continue
        path = os.path.join(directory, name)
        try:
            if remove_own(path):
                removed.append(path)
            else:
                log.warning("%s: left by a killed export, but another user's: kept", path)
        except OSError as exc:
            log.warning("%s: left by a killed export, not removed (%s)", path, exc)
    return removed


@contextlib.contextmanager
def building(tmp: str) -> Iterator[None]:
    """Run the export's work with ``tmp`` removed at the end whatever happens: success (the
    work was renamed away), an error, SIGINT, or SIGTERM (raised as ``Terminated``, a
    ``SystemExit`` with status 143). A SIGTERM that arrives during the removal waits for
    it to finish."""
    from steadytrain.run_support import SignalGuard, Terminated

    guard = SignalGuard()
    guard.install()
    try:
        yield
    finally:
        guard.hold()  # a second SIGTERM now would cut the removal short
        try:
            remove_own(tmp)
        except OSError as exc:  # never in place of the error that stopped the export
            log.warning("%s: the export's temporary was not removed (%s); remove it", tmp, exc)
        finally:
            guard.restore()
    if guard.pending is not None:  # arrived while removing, after the work had finished
        raise Terminated(guard.pending)
