"""Free ports for test servers come from outside the kernel's ephemeral range, where no
outgoing connection can take one between choosing it and the server binding it."""

from __future__ import annotations

import socket

from steadytrain.testing import ports


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    lo, hi = ports._ephemeral_range()
    chosen = ports.free_ports(12)
    assert len(set(chosen)) == 12
    if ports._pool() is not None:  # this machine leaves room outside the range
        assert all(not lo <= p <= hi for p in chosen), (chosen, lo, hi)
    for p in chosen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing was left holding it


def test_a_port_in_use_is_never_chosen(monkeypatch):
    """With a pool of two ports and one of them held by a listener, only the other comes."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    other = ports.free_ports(1)[0]
    monkeypatch.setattr(ports, "_pool", lambda: [busy, other])
    try:
        for _ in range(10):
            assert ports.free_ports(1) == [other]
    finally:
        held.close()


def test_the_pool_falls_back_to_the_kernel_when_the_range_leaves_no_room(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    assert ports._pool() is None
    (p,) = ports.free_ports(1)
    assert 1024 <= p <= 65535
