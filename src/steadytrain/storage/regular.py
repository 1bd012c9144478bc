"""Open a file only when it is what it claims: a regular file (issue 25).

Every reader and writer of a file that another process, an earlier run or a person may have
replaced (ledger and rank files, COMMIT and shards, cache stamps, manifests) opens through
``open_regular_fd``. Mechanism only: callers decide the policy (raise their own error naming
the fix, skip and count, or buffer the records).

- ``O_NONBLOCK`` on open: opening a FIFO never waits for a writer (a FIFO in place of a
  checkpoint shard made every listing and every resume hang); the mode check then refuses it,
  and a regular file's descriptor is made blocking again.
- ``fstat`` of what was opened, not ``stat`` of the name, so a name swapped in between is
  still checked. A device (``/dev/zero`` behind a link) or a directory is refused the same way.
- ``follow_links=False`` adds ``O_NOFOLLOW``: a writer never appends through a symlink.
- ``remove_own`` removes a work directory left behind without following it: a symlink in
  its place goes as a link (what it points at stays whole), another user's is left.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

__all__ = ["NotRegularFileError", "file_kind", "open_regular_fd", "inside", "remove_own"]

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symlink"),
)


class NotRegularFileError(OSError):
    """``path`` exists but is not a regular file; ``kind`` says what it is."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"is {kind}, not a regular file", path)
        self.kind = kind


def file_kind(mode: int) -> str:
    """Words for what a ``st_mode`` is ("a FIFO (named pipe)", "a character device", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular_fd(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    mode: int = 0o666,
    *,
    follow_links: bool = True,
) -> int:
    """A blocking descriptor of the regular file ``path`` (``os.open`` ``flags``); never blocks
    itself. ``NotRegularFileError`` for anything else; ``OSError`` from ``os.open`` as is
    (``ELOOP`` for a final symlink when ``follow_links`` is False). The caller closes it."""
    extra = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        extra |= os.O_NOFOLLOW
    fd = os.open(path, flags | extra, mode)
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise NotRegularFileError(os.fspath(path), file_kind(st_mode))
        os.set_blocking(fd, True)  # no effect on a regular file's reads; plain from here on
    except BaseException:
        os.close(fd)
        raise
    return fd


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """True when ``path`` (every link on the way resolved) is ``root`` or lies below it."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def remove_own(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` without following it; False when it is left because another user
    owns it. A symlink is unlinked (the link, never its target); a directory or file of
    this user goes, a directory with ``rmtree`` (which never follows the links inside it).
    Nothing there is True; any other failure is the ``OSError`` as raised."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if stat.S_ISLNK(st.st_mode):
        os.unlink(path)
    elif st.st_uid != os.geteuid():
        return False
    elif stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return True
