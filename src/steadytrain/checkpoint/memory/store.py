"""Where a node keeps its snapshots, which ones are good, and how many may exist.

``<dir>/<key>/rankNNNNN/step-SSSSSSSSS.snap``: a copy of rank N's state at step S, written
by rank N itself or received from it (a reader does not care which: any complete, verified
copy is a copy). ``key`` = ``<job identity>-<xxh64 of realpath(checkpoint dir)>``, so two
jobs or two tests never see each other's snapshots. Names with ``.tmp`` are unfinished.

Nothing here trusts the directory (``private.py``): ``prepare`` creates and checks the job's
folder (and the per-user default directory) on every start, each owner's folder is checked
before it is written or read, every file is opened with ``O_NOFOLLOW`` and must be this
user's own regular file, and a new file is created with ``O_EXCL``. A copy is usable only
when its header names this run (``run_nonce``): a run that reuses a run directory, a
checkpoint path or a job id never restores what another run left (``_fits``).

Bounded: before a new copy is written into an owner's directory, every copy there but the
newest complete one is deleted (and every unfinished one: each owner directory of a node has
one writer at a time), so at most two generations exist per owner. The tier writes through
``reserve``: the oldest copy's file becomes the next one's temporary file (its RAM reused),
filled through a mapping and published by rename (only a file that passes ``open_own`` is
reused; anything else under such a name is removed, never written). ``need_by_node`` is what
the budget is checked against: two generations of every copy a node holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from typing import Any

import numpy as np
import xxhash

from steadytrain.checkpoint.memory import snapshot as snap
from steadytrain.checkpoint.memory.private import (
    PrivateDirError,
    check_shared_base,
    create_new,
    dir_problem,
    ensure_private_dir,
    open_own,
)
from steadytrain.errors import CheckpointError
from steadytrain.storage.publish import publish_file

__all__ = [
    "PrivateDirError",
    "Store",
    "store_key",
    "snap_name",
    "short",
    "need_by_node",
    "budget_error",
    "free_bytes",
]

log = logging.getLogger("steadytrain.checkpoint")

_SNAP = re.compile(r"^step-(\d{9})\.snap$")
_OWNER = re.compile(r"^rank(\d{5})$")


def snap_name(step: int) -> str:
    return f"step-{step:09d}.snap"


def store_key(job: str, checkpoint_dir: str) -> str:
    """The job's directory name under the memory directory."""
    ident = re.sub(r"[^A-Za-z0-9_.:=-]", "_", job) or "nojob"
    return f"{ident}-{xxhash.xxh64_hexdigest(os.path.realpath(checkpoint_dir).encode())}"


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


class Store:
    """One job's snapshots on this node (``root`` = ``<dir>/<key>``). ``private_base``:
    ``base`` is the per-user default directory, checked like ``root`` (else it is the
    user's, possibly shared: ``check_shared_base``)."""

    def __init__(self, base: str, key: str, private_base: bool = False) -> None:
        self.base = base
        self.root = os.path.join(base, key)
        self.private_base = private_base
        self._checked: set[str] = set()  # directories made or checked by this process

    def prepare(self) -> None:
        """Create and check ``base`` and ``root`` (every start): ``PrivateDirError`` when
        one may be used by another user, ``OSError`` when it cannot be made."""
        if self.private_base:
            ensure_private_dir(self.base)
        else:
            os.makedirs(self.base, mode=0o700, exist_ok=True)
            check_shared_base(self.base)
        ensure_private_dir(self.root)
        self._checked = {self.root}

    def _ready(self, owner: int) -> str:
        """``owner``'s folder, made (0700) and checked once per process."""
        directory = self.owner_dir(owner)
        if directory not in self._checked:
            if self.root not in self._checked:
                self.prepare()
            ensure_private_dir(directory)
            self._checked.add(directory)
        return directory

    def owner_dir(self, owner: int) -> str:
        return os.path.join(self.root, f"rank{owner:05d}")

    def path(self, owner: int, step: int) -> str:
        return os.path.join(self.owner_dir(owner), snap_name(step))

    def steps(self, owner: int) -> list[int]:
        """Steps of the complete-looking copies of ``owner`` (by name), oldest first."""
        try:
            names = os.listdir(self.owner_dir(owner))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _SNAP.match(n)))

    def owners(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _OWNER.match(n)))

    def prune(self, owner: int) -> None:
        """Delete every copy of ``owner`` but the newest complete one, and unfinished ones."""
        directory = self.owner_dir(owner)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return
        keep = _newest_own(directory, names)
        for name in names:
            if name != keep and (_SNAP.match(name) or ".tmp-" in name):
                _unlink(os.path.join(directory, name))

    def reserve(self, owner: int, size: int) -> tuple[str, np.ndarray]:
        """A temporary file of ``size`` bytes for ``owner``'s next copy, mapped writable:
        (its path, the mapping). Pruning as ``write`` does, except that the first older copy
        that is this user's own regular file (``open_own``) is renamed to the temporary name
        instead of deleted, so its pages (tmpfs: RAM) are reused rather than allocated and
        zeroed again; without one, a new file (``O_EXCL``). The space is allocated before
        the mapping is written (``posix_fallocate``): a full tmpfs is an ``OSError`` here,
        never a SIGBUS while the mapping is filled. Finish with ``publish`` or ``discard``."""
        directory = self._ready(owner)
        tmp = os.path.join(directory, f"next.tmp-{os.getpid()}")
        names = os.listdir(directory)
        keep = _newest_own(directory, names)
        fd = None
        for name in sorted(names, key=lambda n: (n != os.path.basename(tmp), n)):  # own first
            if name == keep or not (_SNAP.match(name) or ".tmp-" in name):
                continue
            path = os.path.join(directory, name)
            if fd is None and (fd := _recycle(path, tmp)) is not None:
                continue
            _unlink(path)
        try:
            if fd is None:
                fd = create_new(tmp)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            image = snap.map_fd(fd, size, shared=True)
        except BaseException:
            self.discard(tmp)
            raise
        finally:
            if fd is not None:
                os.close(fd)
        return tmp, image

    def publish(self, tmp: str, owner: int, step: int) -> None:
        """Give a filled ``reserve`` file its name (atomic; no fsync: tmpfs)."""
        publish_file(tmp, self.path(owner, step), durable=False)

    @staticmethod
    def discard(tmp: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)

    def write(self, owner: int, step: int, image: Any) -> None:
        """Publish a copy of ``owner`` at ``step`` (prunes first: two generations at most)."""
        self._ready(owner)
        self.prune(owner)
        snap.write_file(self.path(owner, step), image)

    def scan(
        self, job: str, world: int, part: tuple[int, int] = (0, 1), nonce: str | None = None
    ) -> tuple[dict[int, dict[int, tuple[int, str]]], list[dict[str, Any]]]:
        """Every complete copy whose header verifies and that fits this run (``nonce``), job
        and world size: ``{owner: {step: (file bytes, payload digest)}}``, and what was
        passed over, each with why. ``part`` = (i, n): the i-th of n ranks sharing this node
        checks every n-th owner."""
        found: dict[int, dict[int, tuple[int, str]]] = {}
        passed: list[dict[str, Any]] = []
        for owner in self.owners()[part[0] :: part[1]]:
            directory = self.owner_dir(owner)
            try:
                problem = dir_problem(directory)
            except FileNotFoundError:
                continue
            if problem:  # never listed, never read
                passed.append({"path": directory, "step": 0, "reason": f"{directory} {problem}"})
                continue
            for step in self.steps(owner):
                path = self.path(owner, step)
                try:
                    header = snap.read_header(path)  # the payload is checked when loaded
                    _fits(header, path, job, world, owner, step, nonce)
                    size = os.lstat(path).st_size
                except FileNotFoundError:
                    continue  # pruned by a rank of this node meanwhile
                except (CheckpointError, OSError) as exc:
                    passed.append({"path": path, "step": step, "reason": str(exc)})
                    continue
                found.setdefault(owner, {})[step] = (size, header["payload_xxh3_128"])
        return found, passed

    def drop_after(self, step: int) -> None:
        """Delete copies newer than ``step``: a restore to ``step`` made them a future that
        will not happen (retention would otherwise keep them as "the newest")."""
        for owner in self.owners():
            with contextlib.suppress(OSError):
                if dir_problem(self.owner_dir(owner)):
                    continue  # not this user's: never touched (the scan named it)
            for s in self.steps(owner):
                if s > step:
                    _unlink(self.path(owner, s))

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # rmtree never follows a link


def _newest_own(directory: str, names: list[str]) -> str | None:
    """The newest complete-looking copy in ``names`` that is this user's own file: the one
    retention keeps. (A name of another user's, or a link, is not a copy of ours: were it
    kept as "the newest", every generation would recycle the newest copy of ours.)"""
    for name in sorted((n for n in names if _SNAP.match(n)), reverse=True):
        try:
            os.close(open_own(os.path.join(directory, name), os.O_RDONLY))
            return name
        except (CheckpointError, OSError):
            continue
    return None


def _unlink(path: str) -> None:
    """Remove a name (a link is removed, never followed); a name that cannot be removed (a
    planted directory) is left, with a warning: it is never read or written either."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("memory tier: cannot remove %s (%s); it is left alone", path, exc)


def _recycle(path: str, tmp: str) -> int | None:
    """An open descriptor of ``path`` renamed to ``tmp`` when it is this user's own regular
    file with one link; else None (the caller removes the name)."""
    try:
        fd = open_own(path, os.O_RDWR, write=True)
    except (CheckpointError, OSError):
        return None
    if path != tmp:
        try:
            os.replace(path, tmp)  # the directory is this user's alone: the name is the file
        except OSError:
            os.close(fd)
            return None
    return fd


def short(nonce: Any) -> str:
    """A nonce as the reasons print it (its first 12 digits: enough to tell runs apart)."""
    return f"{nonce[:12]}..." if isinstance(nonce, str) else repr(nonce)


def _fits(
    header: dict[str, Any],
    path: str,
    job: str,
    world: int,
    owner: int,
    step: int,
    nonce: str | None,
) -> None:
    """A verified copy is usable only by the run that wrote it, on the same number of ranks."""
    if header.get("run_nonce") != nonce:
        raise CheckpointError(
            f"{path}: written by another run (nonce {short(header.get('run_nonce'))}, this "
            f"run's is {short(nonce)}): never restored"
        )
    if header.get("job") != job:
        raise CheckpointError(f"{path}: written by job {header.get('job')!r}, not {job!r}")
    if header.get("world_size") != world:
        raise CheckpointError(
            f"{path}: written on {header.get('world_size')} ranks, the job now has {world} "
            "(a changed world restores from durable checkpoints)"
        )
    if header.get("owner") != owner or header.get("step") != step:
        raise CheckpointError(
            f"{path}: holds rank {header.get('owner')} at step {header.get('step')}, "
            "not what its name says; remove it"
        )


def need_by_node(nodes: list[str], sizes: list[int], peer_of: list[int | None]) -> dict[str, int]:
    """Bytes each node holds at most: two generations of its ranks' own copies and of the
    copies they keep for their peers (``sizes[r]``: rank r's snapshot file)."""
    need: dict[str, int] = {n: 0 for n in nodes}
    for r, size in enumerate(sizes):
        need[nodes[r]] += 2 * size
        peer = peer_of[r]
        if peer is not None:
            need[nodes[peer]] += 2 * size
    return need


def budget_error(node: str, need: int, budget: int, directory: str) -> str:
    """The refusal: what is needed, what is allowed, and the fix."""
    return (
        f"memory tier refused: node {node} needs {need} bytes in {directory} for two "
        f"generations of its snapshots (its ranks' own and its peers' copies), and its budget "
        f"is {budget} bytes (checkpoint.memory.budget_bytes; 0 means half the free space of "
        "the directory at start). Raise checkpoint.memory.budget_bytes or give the directory "
        "more room (a larger /dev/shm), or turn the tier off (checkpoint.memory.every_steps "
        "= 0). The memory tier is off for this run; durable checkpoints go on."
    )
