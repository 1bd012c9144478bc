"""Enter a harness node from a forked process: what ``ip netns exec NS`` and
``cgroups.NODE_SHELL`` do to a fresh one, done in place.

A process the fork server forks lives in the server's network and mount namespaces. To be
a node's process it must do, before it runs anything, what iproute2's ``netns exec`` does
(``ip/ipnetns.c``: ``setns`` to ``/run/netns/NS`` with ``CLONE_NEWNET``, a mount namespace
of its own with ``/`` a recursive slave, ``/sys`` remounted for the new network namespace,
``/etc/netns/NS/*`` bound over ``/etc/*``), then what ``NODE_SHELL`` does (the harness's
view of the machine's cgroup tree bound over ``/sys/fs/cgroup``). Python 3.11 has no
``os.setns``/``os.unshare``: libc's are called through ctypes, as are ``mount(2)`` and
``umount2(2)``.

The process must be single-threaded (``unshare(CLONE_NEWNS)`` refuses a process whose
threads share its filesystem state): a forked child is. A failure to enter raises
``NodeEntryError``: a "node" process must never run in the machine's namespaces silently.
Only the cgroup view may fail softly, as ``NODE_SHELL``'s bind does (the process then sees
no quota, and is told so).

No steadytrain import: the fork server (which must not import the package) loads this file
by its path.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["NETNS_RUN_DIR", "NodeEntryError", "enter"]

NETNS_RUN_DIR = "/run/netns"  # where `ip netns add` bind-mounts each namespace
ETC_NETNS = "/etc/netns"
CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_BIND = 4096
MS_REC = 16384
MS_SLAVE = 1 << 19
MNT_DETACH = 2
CGROUP_MISSING = "[nodes] /sys/fs/cgroup not visible in this node"  # NODE_SHELL's words


class NodeEntryError(OSError):
    """The process could not enter the node's namespaces."""


_LIBC: ctypes.CDLL | None = None


def _libc_call(name: str, *args: object, what: str) -> None:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    if getattr(_LIBC, name)(*args) != 0:
        err = ctypes.get_errno()
        raise NodeEntryError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int) -> None:
    _libc_call(
        "mount",
        source.encode(),
        target.encode(),
        None if fstype is None else fstype.encode(),
        ctypes.c_ulong(flags),
        None,
        what=f"mount {source or fstype} on {target}",
    )


def enter(netns: str, cgroup_view: str | None = None) -> list[str]:
    """Make this (single-threaded) process a process of node namespace ``netns``, with
    ``cgroup_view`` over ``/sys/fs/cgroup`` when given. Returns the warnings to print
    (the cgroup view could not be bound); raises ``NodeEntryError`` otherwise."""
    path = os.path.join(NETNS_RUN_DIR, netns)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NodeEntryError(e.errno, f"cannot open {path}: {e.strerror}") from e
    try:
        _libc_call("setns", fd, CLONE_NEWNET, what=f"setns({path}, CLONE_NEWNET)")
    finally:
        os.close(fd)
    _libc_call("unshare", CLONE_NEWNS, what="unshare(CLONE_NEWNS)")
    # Nothing mounted here may reach the machine's mount namespace (ip netns exec: the same).
    _mount("", "/", "none", MS_SLAVE | MS_REC)
    # A /sys that describes this network namespace (its /sys/class/net: lo and eth0).
    flags = 0
    try:
        _libc_call("umount2", b"/sys", MNT_DETACH, what="umount2 /sys")
    except NodeEntryError:  # none mounted, or not ours to unmount: overlay it, as ip does
        if os.statvfs("/sys").f_flag & os.ST_RDONLY:
            flags = MS_RDONLY
    _mount(netns, "/sys", "sysfs", flags)
    etc = os.path.join(ETC_NETNS, netns)
    if os.path.isdir(etc):
        for name in sorted(os.listdir(etc)):
            _mount(os.path.join(etc, name), os.path.join("/etc", name), "none", MS_BIND)
    if cgroup_view is None:
        return []
    try:
        _mount(cgroup_view, "/sys/fs/cgroup", None, MS_BIND | MS_REC)
    except NodeEntryError as e:
        return [f"{CGROUP_MISSING} ({e.strerror})"]
    return []
