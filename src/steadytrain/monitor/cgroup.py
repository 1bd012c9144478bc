"""This process's own CPU cgroup: its CPU quota and how long the kernel throttled it.

A Slurm job, a Kubernetes pod or a container gets its CPU limit as a cgroup quota on *its*
cgroup, not on the machine's root: reading ``/sys/fs/cgroup/cpu/cpu.stat`` (the root's)
sees no quota and no throttling at all. So the cgroup is found the way the kernel names it,
from ``/proc/self/cgroup`` (one ``ID:CONTROLLERS:PATH`` line per hierarchy):

* **v1**: the line whose controllers include ``cpu`` (``4:cpu,cpuacct:/slurm/job_7``); its
  hierarchy is mounted at ``/sys/fs/cgroup/cpu,cpuacct``, ``/sys/fs/cgroup/cpu`` or
  ``/sys/fs/cgroup/cpuacct,cpu``. Quota: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1:
  none); throttled: ``throttled_time`` (ns) in ``cpu.stat``.
* **v2**: the line ``0::PATH``, under ``/sys/fs/cgroup`` (unified) or
  ``/sys/fs/cgroup/unified`` (hybrid). Quota: ``cpu.max`` (``max 100000`` or ``QUOTA
  PERIOD``); throttled: ``throttled_usec`` in ``cpu.stat``. A v1 ``cpu`` controller wins
  (in a hybrid layout the unified hierarchy has no cpu controller).

A limit on an ancestor applies to every cgroup below it, so the directories read are the
process's own and each ancestor up to the hierarchy's root (``CpuCgroup.dirs``): the quota
is the smallest of theirs, and throttling is reported per directory (the caller takes the
largest share). In a container without its own cgroup namespace ``/proc/self/cgroup`` names
the path on the host (``/docker/ID``) while the mount shows the container's subtree: the
leading components are dropped until a directory exists. Nothing here raises: what cannot
be read is None (unknown, never "no quota" or "not throttled" by guess).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

__all__ = ["CpuCgroup", "own_cpu_cgroup", "cpu_quota", "read_text", "throttled_s"]

_V1_MOUNTS = ("cpu,cpuacct", "cpu", "cpuacct,cpu")
_V2_MOUNTS = ("", "unified")
_MAX_DEPTH = 64  # ancestors read at most (a path is a handful deep in practice)


@dataclass(frozen=True)
class CpuCgroup:
    """Where this process's CPU limits live: ``version`` 1 or 2, and ``dirs``, its own
    cgroup directory first, then each ancestor up to the hierarchy's root."""

    version: int
    dirs: tuple[str, ...]


def read_text(path: str, limit: int = 65536) -> str | None:
    """The start of a small /proc or /sys file (``limit`` characters), None when it cannot
    be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None


def _lines(proc: str) -> tuple[str | None, str | None]:
    """(v1 cpu path, v2 path) from ``PROC/self/cgroup``; None where absent."""
    text = read_text(os.path.join(proc, "self", "cgroup")) or ""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        ident, controllers, path = parts
        if "cpu" in controllers.split(","):
            v1 = path
        elif ident == "0" and controllers == "":
            v2 = path
    return v1, v2


def _under(root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` in the hierarchy mounted at ``root``: the path
    itself, else with leading components dropped (a container's own subtree mounted as the
    root), else None."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for i in range(len(parts) + 1):
        d = os.path.join(root, *parts[i:])
        if os.path.isdir(d):
            return d
    return None


def _ancestors(root: str, leaf: str) -> tuple[str, ...]:
    out = [leaf]
    root = os.path.normpath(root)
    while os.path.normpath(out[-1]) != root and len(out) < _MAX_DEPTH:
        parent = os.path.dirname(os.path.normpath(out[-1]))
        if len(parent) < len(root):
            break
        out.append(parent)
    return tuple(out)


def own_cpu_cgroup(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> CpuCgroup | None:
    """This process's CPU cgroup (``proc`` and ``cgroup_root`` stand for ``/proc`` and
    ``/sys/fs/cgroup``; tests pass a fake tree), or None where it cannot be found."""
    v1, v2 = _lines(proc)
    if v1 is not None:
        for name in _V1_MOUNTS:
            root = os.path.join(cgroup_root, name)
            if os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")) or os.path.isfile(
                os.path.join(root, "cpu.stat")
            ):
                leaf = _under(root, v1)
                if leaf is not None:
                    return CpuCgroup(1, _ancestors(root, leaf))
    if v2 is not None:
        for name in _V2_MOUNTS:
            root = os.path.join(cgroup_root, name) if name else cgroup_root
            if os.path.isfile(os.path.join(root, "cgroup.controllers")):
                leaf = _under(root, v2)
                if leaf is not None:
                    return CpuCgroup(2, _ancestors(root, leaf))
    return None


def _quota_of(version: int, d: str) -> float | None:
    """Cores one directory's quota allows, or None (no quota, or unreadable)."""
    with contextlib.suppress(ValueError, IndexError, TypeError, ZeroDivisionError):
        if version == 2:
            text = read_text(os.path.join(d, "cpu.max"))
            if not text or text.split()[0] == "max":
                return None
            q, p = text.split()[:2]
            return float(q) / float(p) if float(q) > 0 else None
        q1 = read_text(os.path.join(d, "cpu.cfs_quota_us"))
        p1 = read_text(os.path.join(d, "cpu.cfs_period_us"))
        if q1 is not None and p1 is not None and float(q1) > 0:
            return float(q1) / float(p1)
    return None


def cpu_quota(cg: CpuCgroup | None) -> float | None:
    """The CPU quota in cores (0.5: half a core) that binds this process: the smallest of
    its cgroup's and its ancestors'; None when none is set (or none can be read)."""
    if cg is None:
        return None
    quotas = [q for d in cg.dirs if (q := _quota_of(cg.version, d)) is not None and q > 0]
    return min(quotas) if quotas else None


def throttled_s(cg: CpuCgroup | None) -> dict[str, float]:
    """Seconds each directory of ``cg`` has been throttled so far (``{dir: s}``, only the
    readable ones): a cumulative counter, so the caller divides the difference of two
    samples by the time between them."""
    out: dict[str, float] = {}
    if cg is None:
        return out
    key, scale = ("throttled_usec", 1e-6) if cg.version == 2 else ("throttled_time", 1e-9)
    for d in cg.dirs:
        for line in (read_text(os.path.join(d, "cpu.stat")) or "").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                with contextlib.suppress(ValueError):
                    v = float(parts[1]) * scale
                    if v >= 0 and v < float("inf"):
                        out[d] = v
                break
    return out
