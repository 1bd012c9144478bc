"""CPU quotas for harness nodes, and the cgroup tree made visible inside a node.

On a cluster a node is slow for its own reasons: a Slurm job's or a container's CPU limit,
a noisy neighbour. On one machine, pinning "nodes" to cores does not make one slower than
another (the vCPUs share a physical core: a busy loop on one slows the other about as
much); a cgroup CPU quota does. ``NodeQuota`` is one node's cgroup under the machine's v1
``cpu`` controller (``/sys/fs/cgroup/cpu,cpuacct`` or ``/sys/fs/cgroup/cpu``), named with
the harness's tag; its processes are moved in by PID, and their children follow.

``ip netns exec`` remounts ``/sys`` in the node's own mount namespace, so ``/sys/fs/cgroup``
is empty there and a rank can never see its own quota or throttling. ``CgroupView`` binds
the machine's cgroup tree (recursively) at a path of the harness, before any node exists,
and ``NODE_SHELL`` binds that view over ``/sys/fs/cgroup`` inside the node before it execs
the node's command (the command keeps the PID the harness was given).

cgroup v2 (a unified hierarchy with the cpu controller) is not supported yet: a quota
there needs the controller enabled down the tree; ``NodeQuota`` says so and stops.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterable, Iterator

__all__ = [
    "CgroupUnavailable",
    "CgroupView",
    "NODE_SHELL",
    "NodeQuota",
    "cpu_root",
    "leftover_cgroups",
]

PERIOD_US = 100_000  # the CFS period: the quota is spent, then the cgroup waits for the next
SYS_CGROUP = "/sys/fs/cgroup"

# Run inside the node (``sh -c NODE_SHELL sh VIEW ARGV...``): the view over /sys/fs/cgroup,
# then exec the command. A failed bind is said and the command still runs (its rank then
# reports no throttling, as before).
NODE_SHELL = (
    'mount --rbind "$0" /sys/fs/cgroup '
    '|| echo "[nodes] /sys/fs/cgroup not visible in this node" >&2; exec "$@"'
)


class CgroupUnavailable(RuntimeError):
    """CPU quotas cannot be set here (no v1 cpu controller, or not allowed)."""


def cpu_root(sys_cgroup: str = SYS_CGROUP) -> str:
    """The v1 ``cpu`` controller's mount, or ``CgroupUnavailable`` saying why not."""
    for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        root = os.path.join(sys_cgroup, name)
        if os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
            return root
    if os.path.isfile(os.path.join(sys_cgroup, "cgroup.controllers")):
        raise CgroupUnavailable(
            f"{sys_cgroup} is cgroup v2: the harness sets CPU quotas through the v1 cpu "
            "controller only (run where /sys/fs/cgroup/cpu exists)"
        )
    raise CgroupUnavailable(f"no cgroup v1 cpu controller under {sys_cgroup}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class NodeQuota:
    """One node's cgroup ``cpu_root()/steadytrain-TAG/NODE``: made on first use, removed
    by ``remove`` once its processes are gone."""

    def __init__(self, tag: str, node: str, sys_cgroup: str = SYS_CGROUP) -> None:
        if os.geteuid() != 0:
            raise CgroupUnavailable(f"not root (euid {os.geteuid()}): a cgroup needs root")
        self.parent = os.path.join(cpu_root(sys_cgroup), f"steadytrain-{tag}")
        self.path = os.path.join(self.parent, node)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise CgroupUnavailable(f"cannot make {self.path}: {e}") from e

    def set(self, cores: float | None) -> None:
        """Allow ``cores`` CPUs (0.25: a quarter of one) from now on; None: no limit."""
        _write(os.path.join(self.path, "cpu.cfs_period_us"), str(PERIOD_US))
        quota = -1 if cores is None else max(1000, round(cores * PERIOD_US))
        _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(quota))

    def add(self, pids: Iterable[int]) -> set[int]:
        """Move each process (all its threads) in; returns those moved (a process that
        exited meanwhile is skipped)."""
        moved = set()
        for pid in pids:
            try:
                _write(os.path.join(self.path, "cgroup.procs"), str(pid))
                moved.add(pid)
            except OSError as e:
                if e.errno != errno.ESRCH:
                    raise
        return moved

    def pids(self) -> set[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return {int(x) for x in f.read().split()}
        except OSError:
            return set()

    def remove(self, wait_s: float = 5.0) -> bool:
        """Remove the cgroup (and the tag's directory once empty); its processes must be
        gone: a killed one leaves the cgroup when it is reaped, so this retries for up to
        ``wait_s``. True when removed."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        with contextlib.suppress(OSError):
            os.rmdir(self.parent)  # the last node's removal empties it
        return True


def leftover_cgroups(tag: str, sys_cgroup: str = SYS_CGROUP) -> list[str]:
    """The tag's cgroups still present (empty after a clean teardown)."""
    try:
        parent = os.path.join(cpu_root(sys_cgroup), f"steadytrain-{tag}")
    except CgroupUnavailable:
        return []
    return [f"cgroup {parent}"] if os.path.isdir(parent) else []


class CgroupView:
    """``/sys/fs/cgroup`` bound (recursively, private) at ``path`` while open."""

    def __init__(self, path: str, source: str = SYS_CGROUP) -> None:
        self.path, self.source = path, source

    @contextlib.contextmanager
    def mounted(self) -> Iterator[str]:
        os.makedirs(self.path, exist_ok=True)
        subprocess.run(["mount", "--rbind", self.source, self.path], check=True,
                       capture_output=True, text=True)  # fmt: skip
        try:
            # Private: nothing mounted under it later propagates to the machine's tree.
            subprocess.run(["mount", "--make-rprivate", self.path], check=False,
                           capture_output=True)  # fmt: skip
            yield self.path
        finally:
            # Lazy: detaches the whole tree at once, even while a node still holds it.
            subprocess.run(["umount", "-l", self.path], check=False, capture_output=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
