"""The memory tier's files belong to the user who runs the job, and to nobody else.

Why (issue 40): ``/dev/shm`` is writable by every local user. With one fixed directory name
for all users, created without checking its mode or owner, another user could pre-create it,
plant a symlink where the job writes (a root job then overwrote an unrelated 0600 file), a
symlink to a file of their own (which then received the job's weights, optimizer and RNG
state), or a snapshot of their making (which was restored). So:

- the default directory is per user, ``/dev/shm/steadytrain-<uid>`` (``default_dir``),
  created 0700; every directory the tier creates (that one, the job's folder under any
  directory, each owner's folder) is checked on every start (``ensure_private_dir``): a
  symlink, another owner or any group/other permission is refused with a ``PrivateDirError``
  that names it and the fix, and the tier is off for the run (training goes on);
- a directory the user gives (``checkpoint.memory.dir``, ``$STEADYTRAIN_MEMORY_DIR``) may be
  shared, like ``/dev/shm`` itself, but must belong to this user or root and not be
  writable by others without the sticky bit (``check_shared_base``): otherwise another user
  could rename the job's folder away and put one of theirs in its place;
- every file is opened with ``O_NOFOLLOW`` and checked on its descriptor (``open_own``): a
  regular file owned by this user, and, to be written, with one link (a hard link to a file
  elsewhere is never written through). Anything else is a ``ForeignFileError`` naming it:
  it is never read and never written. New files are created with ``O_EXCL``
  (``create_new``): a name planted in between is an error, never opened.

Why not ``$XDG_RUNTIME_DIR`` (``/run/user/<uid>``, private by construction): logind caps it
at 10 % of RAM by default (the tier needs about 4x the state of a node's ranks), removes it
when the user's last session ends (a batch job has no session of its own, so the snapshots
could vanish between a crash and the restart), and Slurm hands the submitting host's value
to compute nodes, where that directory often does not exist.
"""

from __future__ import annotations

import errno
import os
import stat

from steadytrain.errors import CheckpointError

__all__ = [
    "ForeignFileError",
    "PrivateDirError",
    "check_shared_base",
    "create_new",
    "default_dir",
    "dir_problem",
    "ensure_private_dir",
    "open_own",
]

SHM = "/dev/shm"


class PrivateDirError(CheckpointError):
    """A directory the tier would use is not this user's alone: the tier is off."""


class ForeignFileError(CheckpointError):
    """A file in the tier's directory that is not this user's own regular file."""


def _uid() -> int:
    return os.geteuid()  # the owner of what this process creates


def default_dir() -> str:
    """``/dev/shm/steadytrain-<uid>``: node-local RAM, one directory per user."""
    return os.path.join(SHM, f"steadytrain-{_uid()}")


def dir_problem(path: str) -> str | None:
    """Why ``path`` is not a directory of this user's alone (a symlink, not a directory,
    another owner, any group/other permission), with the fix; None when it is one."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)!r}). Fix: remove the link (rm {path})"
    if not stat.S_ISDIR(st.st_mode):
        return f"is not a directory. Fix: remove it (rm {path})"
    if st.st_uid != _uid():
        return (
            f"is owned by uid {st.st_uid}, not by this user (uid {_uid()}): another user made "
            f"it. Fix: have it removed (by its owner or root: rm -rf {path}), or give "
            "checkpoint.memory.dir a directory of your own"
        )
    if st.st_mode & 0o077:
        return (
            f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may use it, and anything in "
            f"it may have been planted. Fix: remove it (rm -rf {path}: it holds only memory "
            "snapshots); the next start creates it with mode 0700"
        )
    return None


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700; its parent must exist) unless it exists, then check it
    (``dir_problem``): ``PrivateDirError`` naming it and the fix."""
    try:
        os.mkdir(path, 0o700)  # never follows a planted link: an existing name is an error
    except FileExistsError:
        pass
    problem = dir_problem(path)
    if problem:
        raise PrivateDirError(
            f"memory directory {path} {problem}. The memory tier uses only directories of "
            "this user's alone"
        )


def check_shared_base(path: str) -> None:
    """A directory the user gave (it may be shared, like /dev/shm) must exist as a
    directory, belong to this user or root, and, when other users may write into it, have
    the sticky bit (then they cannot rename or remove what this user created in it)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(
            f"memory directory {path} is not a directory; give checkpoint.memory.dir a "
            "node-local directory (a tmpfs such as /dev/shm)"
        )
    if st.st_uid not in (0, _uid()):
        raise PrivateDirError(
            f"memory directory {path} is owned by uid {st.st_uid}, neither this user (uid "
            f"{_uid()}) nor root: its owner could replace the job's folder in it. Fix: give "
            "checkpoint.memory.dir a directory of your own (or /dev/shm)"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise PrivateDirError(
            f"memory directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may "
            "write into it and, without the sticky bit, replace the job's folder in it. Fix: "
            f"chmod +t {path} (as /dev/shm is), chmod go-w {path}, or use a directory of your "
            "own"
        )


def _refuse(path: str, why: str) -> ForeignFileError:
    return ForeignFileError(f"{path}: {why}; never read or written by the memory tier")


def open_own(path: str, flags: int, *, write: bool = False) -> int:
    """``os.open(path, flags | O_NOFOLLOW)`` of this user's own regular file (with one link
    when ``write``), or ``ForeignFileError`` naming it (``FileNotFoundError`` as is)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link, not a snapshot file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "not a regular file")
        if st.st_uid != _uid():
            raise _refuse(path, f"not owned by this user (owner uid {st.st_uid}, this is {_uid()})")
        if write and st.st_nlink != 1:
            raise _refuse(path, f"has {st.st_nlink} hard links (a link to a file elsewhere)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path: str) -> int:
    """A new, empty file at ``path`` (0600), open for reading and writing; a name that
    exists (planted, or left behind) is ``FileExistsError``, never opened."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)
