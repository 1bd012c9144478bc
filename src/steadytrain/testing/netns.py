"""The Linux plumbing under the node harness: a bridge, a network namespace per node, and
finding and killing a node's processes by PID.

Kept apart from ``nodes`` (which decides *what* a node is) so that the ``ip`` command lines
and the process bookkeeping read in one place. Everything here acts only on names this
harness made: interfaces and namespaces carry the harness's random tag, addresses come from
a private /24 (``10.213.N.0/24``) that no other interface on this machine uses, and no
namespace gets a default route, so a node can reach its bridge and its peers and nothing
else.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator

__all__ = [
    "ETC_NETNS",
    "NetnsUnavailable",
    "SUBNET_PREFIX",
    "alive",
    "allocate_subnet",
    "check_netns",
    "ip",
    "add_namespace",
    "kill_pids",
    "leftovers",
    "make_bridge",
    "marked_pids",
    "netns_pids",
    "remove_namespace",
]

SUBNET_PREFIX = "10.213"  # the harness owns 10.213.N.0/24; N is chosen free per harness
ETC_NETNS = "/etc/netns"  # ip-netns(8): files mounted over /etc in a namespace
# Not "steadytrain-nodes.lock": that name is the one developers wrap whole harness runs
# in (`flock /tmp/steadytrain-nodes.lock pytest tests/nodes`), which then deadlocked here.
_LOCK = os.path.join(tempfile.gettempdir(), "steadytrain-netns-subnet.lock")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no ``ip``, or not allowed)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; a failure raises with the command and ``ip``'s own message."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


def check_netns() -> None:
    """Raise ``NetnsUnavailable`` with the reason when namespaces cannot be made here."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"not root (euid {os.geteuid()}): `ip netns add` needs root")


@contextlib.contextmanager
def allocate_subnet() -> Iterator[str]:
    """Yield a free ``10.213.N`` prefix, holding a machine-wide lock until the caller has put
    its bridge address on it (two harnesses starting together must not pick the same N)."""
    with open(_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            used = ip("-o", "-4", "addr", "show").stdout
            nets = [ipaddress.ip_network(w, strict=False) for w in used.split() if "/" in w]
            for n in range(256):
                net = ipaddress.ip_network(f"{SUBNET_PREFIX}.{n}.0/24")
                if not any(net.overlaps(other) for other in nets):
                    yield f"{SUBNET_PREFIX}.{n}"
                    return
            raise NetnsUnavailable(f"every {SUBNET_PREFIX}.N.0/24 is in use on this machine")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make_bridge(tag: str) -> tuple[str, str]:
    """A bridge ``st{tag}br`` owning ``PREFIX.1/24`` on a free prefix; returns (bridge,
    prefix). Also proves that a namespace can be made: a container may allow one and not
    the other, and the first node would otherwise fail later with less context."""
    bridge = f"st{tag}br"
    with allocate_subnet() as prefix:
        ip("link", "add", bridge, "type", "bridge")
        try:
            ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
            ip("link", "set", bridge, "up")
            ip("netns", "add", f"st-{tag}-probe")
            ip("netns", "del", f"st-{tag}-probe")
        except NetnsUnavailable:
            ip("link", "del", bridge, check=False)
            raise
    return bridge, prefix


def add_namespace(ns: str, host_end: str, bridge: str, addr: str, hosts: list[str]) -> None:
    """Namespace ``ns`` with ``eth0`` at ``addr``/24, a veth whose other end ``host_end``
    is in ``bridge``, loopback up, and no default route. ``ip netns exec`` mounts
    ``/etc/netns/NS/*`` over ``/etc``: the node gets its own hosts file (``hosts`` lines) and
    a resolv.conf without name servers, so no name lookup inside a node leaves the machine."""
    ip("netns", "add", ns)
    ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
    ip("link", "set", host_end, "master", bridge, "up")
    ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "link", "set", "lo", "up")
    etc = os.path.join(ETC_NETNS, ns)
    os.makedirs(etc, exist_ok=True)
    with open(os.path.join(etc, "hosts"), "w") as f:
        f.write("\n".join(["127.0.0.1 localhost", *hosts]) + "\n")
    with open(os.path.join(etc, "resolv.conf"), "w") as f:
        f.write("# steadytrain node harness: no name server inside a node\n")


def remove_namespace(ns: str, host_end: str) -> None:
    """Undo ``add_namespace``. Deleting a namespace destroys its veth pair only
    asynchronously: the host end goes first, so the pair is gone when this returns."""
    ip("link", "del", host_end, check=False)
    ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def leftovers(ns_prefix: str, link_prefix: str) -> list[str]:
    """Namespaces, their /etc files and links whose names start with these prefixes."""
    out = [f"namespace {w}" for w in ip("netns", "list", check=False).stdout.split()]
    out = [w for w in out if w.startswith(f"namespace {ns_prefix}")]
    with contextlib.suppress(FileNotFoundError):
        out += [f"file {ETC_NETNS}/{d}" for d in os.listdir(ETC_NETNS) if d.startswith(ns_prefix)]
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(link_prefix):
            out.append(f"link {name}")
    return out


def netns_pids(netns: str) -> set[int]:
    """PIDs of every process in network namespace ``netns`` (``ip netns pids``)."""
    r = ip("netns", "pids", netns, check=False)
    return {int(p) for p in r.stdout.split() if p.isdigit()}


def marked_pids(marker: str) -> set[int]:
    """PIDs whose environment holds ``marker`` (``NAME=VALUE``): a node's processes that
    left its namespace or were orphaned by a killed parent still carry the node's mark."""
    needle = marker.encode() + b"\0"
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read() + b"\0"
        except OSError:
            continue  # gone, or a kernel thread
        if b"\0" + needle in b"\0" + env:
            found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has finished: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def kill_pids(pids: Iterable[int], *, grace_s: float = 0.0) -> list[tuple[int, str]]:
    """Stop ``pids``: SIGTERM and up to ``grace_s`` seconds to exit when ``grace_s`` > 0, then
    SIGKILL, each by its PID. Returns ``(pid, cmdline)`` of the processes that needed the
    SIGKILL after a grace period (stuck ones), so the caller can say so."""
    pids = {p for p in pids if p != os.getpid()}
    names = {p: _cmdline(p) for p in pids}
    if grace_s > 0:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.05)
    survivors = sorted(p for p in pids if alive(p))
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in survivors):
        time.sleep(0.02)
    return [(p, names[p]) for p in survivors] if grace_s > 0 else []
