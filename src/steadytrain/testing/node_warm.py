"""A warm process per harness node, so that the node's ranks fork too.

A torchrun agent forked into a node (``forkserver``, ``node_entry``) still starts its
workers fresh with ``subprocess``: each rank of each attempt pays torch's and steadytrain's
imports again (~3.3 s of CPU here). The product's cure is a warm process per node
(``python -m steadytrain.warm --socket PATH SCRIPT``, docs/operations.md): torchrun's entry
becomes ``-m steadytrain.warm.enter SCRIPT ARGS``, a standard-library process that has the
worker forked from the warm process. Here each node's warm process is itself forked from
the fork server into its node (most of its preload is inherited), at the first job that
node runs, and serves ``steadytrain.train.demo_run.train_entry()`` (the CLI with a
training process's imports made top-level): what ``-m steadytrain.cli`` ranks become.

Its workers are its children, inside the node: ``NodeHarness.pids`` finds them by the
node's namespace, ``kill`` ends them with the node (the warm process, SIGKILLed with them,
is started again by the node's next job), and ``workers`` names them for a test that must
hold one rank (the agent's own child is then the ``enter`` process).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CLI", "WARM_WAIT_S", "NodeWarm", "warm_args"]

CLI = ["-m", "steadytrain.cli"]
# How long a job waits for its nodes' warm processes to listen (a fork, then steadytrain's
# and the entry's imports and one optimizer step: seconds, a minute at load 40) before its
# ranks start fresh as they used to: the job's own timeouts are never spent on the preload.
WARM_WAIT_S = 60.0


def warm_args(args: list[str], script: str) -> list[str] | None:
    """torchrun's script arguments with the CLI's ranks entering a warm process for
    ``script``; None when ``args`` do not run the CLI (a trainer script, another module)."""
    if args[: len(CLI)] != CLI:
        return None
    return ["-m", "steadytrain.warm.enter", script, *args[len(CLI) :]]


class NodeWarm:
    """The warm processes of one harness: one per node, started by ``start`` through
    ``popen(node_name, argv, log_path)`` (the harness's, forking into the node)."""

    def __init__(self, popen: Callable[[Any, list[str], str], Any], log: Callable[[str], None]):
        self._popen, self._log = popen, log
        self._root = ""  # a private directory with a short path (a socket path: < 108 bytes)
        self._procs: dict[str, tuple[Any, str]] = {}  # node name -> (warm process, socket)
        self._count = 0

    def start(self, node: Any, script: str) -> None:
        """Start ``node``'s warm process unless one runs (it is not waited for here)."""
        running = self._procs.get(node.name)
        if running is not None and running[0].poll() is None:
            return
        if not self._root:
            self._root = tempfile.mkdtemp(prefix="st-warm-", dir="/tmp")
        self._count += 1
        sock = os.path.join(self._root, f"{self._count}.sock")
        argv = ["-m", "steadytrain.warm", "--socket", sock, script]
        proc = self._popen(node, argv, sock[: -len(".sock")] + f"-{node.name}.log")
        self._procs[node.name] = (proc, sock)

    def socket(self, node: Any, wait_s: float = WARM_WAIT_S) -> str | None:
        """``node``'s warm socket once it listens (up to ``wait_s``); None when it does not
        in time or its process ended (said in the log: the ranks start fresh)."""
        proc, sock = self._procs[node.name]
        deadline = time.monotonic() + wait_s
        while not os.path.exists(sock):  # bound after the preload: it answers from then on
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"ended ({proc.returncode})" if proc.returncode is not None else "slow"
                self._log(f"[nodes] {node.name}: warm process {why}, its ranks start fresh "
                          f"(log {sock[: -len('.sock')]}-{node.name}.log)")  # fmt: skip
                return None
            time.sleep(0.05)
        return sock

    def pid(self, node: Any) -> int | None:
        """The pid of ``node``'s warm process while it runs."""
        running = self._procs.get(node.name)
        return running[0].pid if running and running[0].poll() is None else None

    def close(self) -> None:
        """After the harness stopped every node's processes: remove the socket directory."""
        if self._root:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = ""
        self._procs.clear()
