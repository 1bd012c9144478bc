"""Which node this process runs on, as every part of steadytrain names it.

One definition: the memory tier pairs ranks by it and every record of the run carries it,
so a node is the same node everywhere. ``STEADYTRAIN_NODE`` overrides the host name: the
node harness and the tests run several "nodes" on one machine. (Which ranks share a local
directory is asked of the filesystem instead, ``checkpoint/download.py``: a name can be
shared by machines that share no disk.)
"""

from __future__ import annotations

import os
import socket

__all__ = ["ENV_NODE", "node_name"]

ENV_NODE = "STEADYTRAIN_NODE"


def node_name() -> str:
    """This node's name: ``STEADYTRAIN_NODE``, else the host name."""
    return os.environ.get(ENV_NODE) or socket.gethostname()
