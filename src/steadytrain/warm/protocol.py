"""The warm process's wire format, shared by ``server.py`` and ``enter.py`` (standard
library only: the entry point must not import torch).

A ``SOCK_SEQPACKET`` Unix socket (message boundaries kept, so one JSON message is one
``recv``). The entry sends ``{"argv", "env", "cwd", "umask"}`` with its stdin, stdout and
stderr (``SCM_RIGHTS``); the warm process answers ``{"pid"}`` once it forked the worker
and ``{"exit": code}`` when the worker ends (negative: killed by that signal, as
``subprocess`` reports it), or ``{"error"}`` when it cannot start it. If the entry's end
closes first (torchrun killed it), the warm process SIGKILLs that worker: a worker never
outlives the process torchrun watches.
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["ENV_SOCKET", "MAX_MESSAGE", "recv", "send"]

ENV_SOCKET = "STEADYTRAIN_WARM_SOCKET"
MAX_MESSAGE = 1 << 20  # an environment of a few hundred KB fits


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` at the end."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, maxfds)
    if not data:
        for fd in fds:
            socket.close(fd)
        return None, []
    return json.loads(data), fds
