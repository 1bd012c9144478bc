"""Open only regular files inside a checkpoint root (issue 25, "files are what they claim").

A checkpoint directory is untrusted input: a FIFO in place of a file that COMMIT lists made
``steadytrain checkpoints`` and every resume block forever in ``open()``, and a device
(``/dev/zero``) would be read without end. Every reader in ``checkpoint/`` therefore opens
through ``open_regular``: ``stat`` first (a FIFO is never opened), then ``O_NONBLOCK`` (a
file swapped for a FIFO between the two does not block the open) and ``fstat`` of what was
actually opened. Anything but a regular file is a ``CheckpointError`` naming the file, which
callers treat as "this checkpoint does not verify".
"""

from __future__ import annotations

import errno
import os
import stat

from steadytrain.errors import CheckpointError
from steadytrain.storage.regular import NotRegularFileError as StorageNotRegular
from steadytrain.storage.regular import file_kind, inside, open_regular_fd

__all__ = ["NotRegularFileError", "open_regular", "stat_regular", "read_regular", "inside"]


class NotRegularFileError(CheckpointError):
    """A FIFO, device, socket or directory where a checkpoint holds a regular file (or a link
    leaving the root): what it names is damage, not a read error to retry."""


_FIX = "it is not a file a checkpoint writes; this checkpoint does not verify"


def _refuse(path: str, kind: str) -> CheckpointError:
    return NotRegularFileError(f"{path}: is {kind}, not a regular file; {_FIX}")


def _missing(path: str, exc: OSError) -> CheckpointError:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return CheckpointError(f"{path}: listed in COMMIT but missing")
    return CheckpointError(f"{path}: cannot be read ({exc.strerror}); check its permissions")


def stat_regular(path: str) -> os.stat_result:
    """``os.stat`` of ``path`` (links followed), or CheckpointError unless a regular file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _missing(path, exc) from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, file_kind(st.st_mode))
    return st


def open_regular(path: str) -> int:
    """A blocking read-only descriptor of the regular file ``path``; never blocks itself.

    ``stat`` first, so a FIFO is never opened (opening one can wake a writer waiting on it);
    then ``O_NONBLOCK`` and ``fstat``, so a name swapped for a FIFO in between still cannot
    block. The caller closes the descriptor.
    """
    stat_regular(path)
    try:
        return open_regular_fd(path)
    except StorageNotRegular as exc:
        raise _refuse(path, exc.kind) from None
    except OSError as exc:
        raise _missing(path, exc) from None


def read_regular(path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (a huge file costs
    no memory: the caller compares the length with what it expected)."""
    fd = open_regular(path)
    with open(fd, "rb", closefd=True) as f:
        return f.read() if limit is None else f.read(limit)
