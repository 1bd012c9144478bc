"""Free TCP ports for the servers that tests, demos and benchmarks start, chosen so that
nothing else on the machine is likely to take them before the server binds.

The usual trick (bind port 0, read the port, close the socket, hand the number on) draws
from the kernel's *ephemeral* range, the same range every outgoing connection's local port
comes from. On a busy test machine (S3 clients, rendezvous stores, a second replay running
beside) an outgoing connection can take the port in the gap before the server binds it:
CI saw SeaweedFS's volume server die with ``bind: address already in use`` exactly so. The
kernel never hands out a port outside ``net.ipv4.ip_local_port_range`` on its own, so ports
drawn at random from below that range can only collide with another server that chose
explicitly, which is rare and which the callers' retries absorb.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_ports"]

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # below this sit well-known services' ports (databases, web servers)
_MIN_POOL = 2000  # fewer candidates than this outside the ephemeral range: use the kernel's


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(_RANGE_FILE) as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _pool() -> range | None:
    """Ports the kernel never assigns by itself, or None when the machine leaves too few."""
    lo, hi = _ephemeral_range()
    if lo - _LOWEST >= _MIN_POOL:
        return range(_LOWEST, lo)
    if 65535 - hi >= _MIN_POOL:
        return range(hi + 1, 65536)
    return None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, outside the ephemeral range where it has
    room (see the module docstring). The sockets are held open together while choosing, so
    the ports differ, and bound without ``SO_REUSEADDR``, so a port with connections still
    in TIME_WAIT is passed over."""
    pool = _pool()
    rng = random.SystemRandom()  # two sessions started together must not draw alike
    socks: list[socket.socket] = []
    try:
        tries = 0
        while len(socks) < n:
            s = socket.socket()
            port = 0 if pool is None or tries > 50 * n else rng.choice(pool)
            tries += 1
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
