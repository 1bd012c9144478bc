"""A remote checkpoint's local copy for restore: one per node, not one per rank.

The ranks that share a local checkpoint directory (a node's ranks, or every rank when the
directory is a filesystem the nodes share: its ``mates``) share its copy of a candidate.
Who shares is asked of the filesystem, not of names: each rank makes a probe directory
there and looks for the others' (``NodeCopies.open``), so two nodes with one host name
never take each other's files for their own. First they check the staging copy,
each mate checksumming its part of the files; if that copy is not whole and good, they
download the checkpoint once into one directory, ``LOCAL_ROOT/.restore-NAME-rankL-PID``
(L: the node's lowest rank, PID: its process), each mate its part of the files, and then
each checksums its part. Eight ranks on a node so move and hash a checkpoint once, not eight
times, and need room for one copy, not eight.

Every rank makes the same two all-gathers per candidate, whatever its node does (the
ranks of other nodes may be downloading), so the group's collectives stay in step. A rank
that fails raises its own error; its mates raise ``ByMate`` (their part is not usable, and
the failing rank's error is the one to report). The node's lowest rank removes the
download after the candidate's last collective (``release``); one left by a killed process
is removed by that rank's next restore on the node (``sweep``).

The download directory is never followed (``own_dir``): each mate makes it (mode 0700) or
joins it only when it is a real directory of this user. A symlink in its place (another
user who can write the local root planted it, pointing at a directory of the job's user)
is removed as a link, never written through; a directory of another user there is refused
naming it. ``release`` and ``sweep`` remove links as links and leave other users' entries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from steadytrain.checkpoint import commit as C
from steadytrain.checkpoint.identity import pid_gone
from steadytrain.checkpoint.remote import Root
from steadytrain.checkpoint.writer import FAILURES, Group
from steadytrain.errors import CheckpointError
from steadytrain.storage.regular import file_kind, remove_own

__all__ = ["PREFIX", "ByMate", "NodeCopies", "own_dir", "runs", "sharing", "sweep"]

PREFIX = ".restore-"

log = logging.getLogger(__name__)


class ByMate(Exception):  # noqa: N818 - not an error of this rank: a signal
    """A mate on this node could not provide its part: its own error says why."""


@dataclass
class NodeCopies:
    """This rank's view of its node's copies of remote checkpoints (``open`` makes it)."""

    group: Group
    local: Root
    remote: Root
    mates: list[int]  # the ranks sharing this rank's local directory, ascending
    leader_pid: int  # the process of the lowest of them, whose name the download takes
    tmp: str = ""  # the download in use for the current candidate ("" for none)
    downloaded: int = 0  # bytes this rank downloaded for the current candidate

    @classmethod
    def open(cls, group: Group, local: Root, remote: Root) -> NodeCopies:
        """Two all-gathers: which ranks share this rank's directory. Each rank makes a probe
        there, then says whose probes it sees (as runs of ranks: a few numbers even when
        thousands of ranks share one filesystem); see ``sharing``."""
        rank, pid = group.rank, os.getpid()
        probe = os.path.join(local.root, _probe(rank, pid))
        try:
            os.makedirs(probe, exist_ok=True)
            made = True
        except OSError:
            made = False  # no directory to share: this rank goes alone (its restore says why)
        facts = group.all_gather((made, pid))
        try:
            there = set(os.listdir(local.root))
        except OSError:
            there = set()
        saw = [r for r, (ok, p) in enumerate(facts) if ok and _probe(r, p) in there]
        seen = group.all_gather(runs(saw))
        with contextlib.suppress(OSError):
            os.rmdir(probe)
        mates = sharing(seen, rank)
        return cls(group, local, remote, mates, facts[mates[0]][1])

    @property
    def part(self) -> tuple[int, int]:
        return self.mates.index(self.group.rank), len(self.mates)

    def fetch(self, cand: dict) -> str:
        """A verified local directory with checkpoint ``cand``: the node's staging copy or
        the node's download. Raises this rank's own error, else ``ByMate``."""
        name, manifest = cand["name"], cand["manifest"]
        self.tmp, self.downloaded = "", 0
        here = os.path.join(self.local.root, name)
        own: BaseException | None = None
        whole = False
        try:
            C.verify_local(here, manifest, part=self.part)
            whole = True
        except CheckpointError:
            pass  # not staged here, or not all of it: download
        except FAILURES as exc:  # noqa: BLE001 - reported once the node has agreed
            own = exc
        first = self.group.all_gather((whole, own is not None))
        ours = [first[m] for m in self.mates]
        use_here = all(w for w, _ in ours)
        if not use_here and not any(f for _, f in ours):
            self.tmp = os.path.join(
                self.local.root, f"{PREFIX}{name}-rank{self.mates[0]}-{self.leader_pid}"
            )
            i, n = self.part
            mine = manifest["files"][i::n]
            try:
                own_dir(self.tmp)  # made or joined, never followed
                self.remote.download(name, [f["path"] for f in mine], self.tmp)
                self.downloaded = sum(int(f["size"]) for f in mine)
            except FAILURES as exc:  # noqa: BLE001 - reported once the node has agreed
                own = exc
        second = self.group.all_gather(own is not None)
        if own is not None:
            raise own
        if any(second[m] or first[m][1] for m in self.mates):
            raise ByMate
        if use_here:
            return here
        # every part has arrived: sizes of all, checksums of this rank's part (the same
        # files it downloaded: ``part`` picks every n-th file, as the split did)
        C.verify_local(self.tmp, manifest, part=self.part)
        return self.tmp

    def release(self) -> None:
        """After the candidate's last collective: the node's lowest rank removes its
        download (a dead store, a full disk, a damaged file: what arrived goes too)."""
        if self.tmp and self.group.rank == self.mates[0]:
            _remove(self.tmp)
        self.tmp = ""


def _probe(rank: int, pid: int) -> str:
    return f"{PREFIX}probe-rank{rank}-{pid}"


Runs = tuple[tuple[int, int], ...]


def runs(ranks: Iterable[int]) -> Runs:
    """Sorted ranks as ``(first, last + 1)`` runs: a node's ranks are one run, and so are all
    of a job's when they share one filesystem."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return tuple(out)


def sharing(seen: list[Runs], rank: int) -> list[int]:
    """The ranks ``rank`` shares its directory with (itself included), from whose probes
    each rank saw (``seen[r]``, as ``runs``). Ranks share when they saw the very same
    probes, their own among them: on one directory every rank sees every probe, and a
    rank that saw one late (or could not make its own) goes alone. The groups split the
    ranks with no overlap, and every rank computes them from the same ``seen``, so two
    ranks that split a download both know it. Linear in the ranks."""
    mine = seen[rank]
    group = [r for r, s in enumerate(seen) if s == mine and any(a <= r < b for a, b in mine)]
    return group if rank in group else [rank]


def sweep(local: Root, rank: int) -> None:
    """Remove download directories named for ``rank`` whose process is gone (a SIGKILL
    mid-download). Only those named for this rank (the other ranks' may be in use now, in
    the same directory) and only of a process not running on this node."""
    pattern = re.compile(re.escape(PREFIX) + rf".+-rank{rank}-(\d+)$")
    try:
        names = os.listdir(local.root)
    except OSError:
        return  # no local directory yet: nothing was left
    for name in names:
        m = pattern.match(name)
        if m and _gone(int(m.group(1))):
            _remove(os.path.join(local.root, name))


def own_dir(path: str) -> None:
    """Make the download directory ``path`` (0700), or join it when a mate made it first:
    only ever a real directory of this user. A symlink in its place is removed as a link
    and the directory made; anything else that is not this user's directory is a
    CheckpointError naming it. Checked with ``lstat`` after the ``mkdir``, so a link
    planted in between is seen, not followed."""
    for _ in range(2):  # a link removed once; one that reappears at once is refused below
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            break
        log.warning("%s: a symlink where this restore downloads; removed (not followed)", path)
        with contextlib.suppress(FileNotFoundError):  # a mate removed it first
            os.unlink(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        return
    if stat.S_ISLNK(st.st_mode):
        what = "a symlink, planted again as soon as it was removed"
    elif stat.S_ISDIR(st.st_mode):
        what = f"a directory of uid {st.st_uid}, not this user's"
    else:
        what = f"{file_kind(st.st_mode)}, not a directory"
    raise CheckpointError(
        f"{path}: {what}, where this restore downloads a checkpoint; nothing was written "
        "there. Another user can write the local checkpoint directory: give it to this "
        "user alone (chmod 700), or remove that entry"
    )


def _remove(path: str) -> None:
    """Remove a download without following it (``remove_own``); never fails the restore."""
    try:
        if not remove_own(path):
            log.warning("%s: another user's, left where a download goes", path)
    except OSError as exc:
        log.warning("%s: download not removed (%s)", path, exc)


def _gone(pid: int) -> bool:
    # this process's own earlier attempt counts as gone: it is not downloading now
    return pid == os.getpid() or pid_gone(pid, None)
