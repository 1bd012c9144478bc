"""torchrun's entry point for a worker forked from the node's warm process.

    torchrun ... -m steadytrain.warm.enter train.py --its-args
    (with STEADYTRAIN_WARM_SOCKET=PATH, the socket of ``python -m steadytrain.warm``)

Standard library only, so this process starts in tens of milliseconds. It asks the warm
process for a worker (``protocol.py``), forwards SIGTERM, SIGINT and SIGHUP to it, and ends
the way it ended (the same exit status or signal), so torchrun's agent sees the worker's
own outcome. A killed worker's end is read here as it happens (``_worker_end``), not only
from the warm process's report: torchrun reports the failures it has seen when the first
one ends, so a SIGKILLed rank's entry must end before its peers' errors do. Without an answer it warns and runs the script in this process, cold: a
missing warm process costs the imports, never the job.
"""

from __future__ import annotations

import os
import runpy
import select
import signal
import socket
import sys
from collections.abc import Sequence

from steadytrain.warm import protocol

__all__ = ["main"]

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _cold(script: str, args: Sequence[str], why: str) -> None:
    """Run ``script`` here, as ``python SCRIPT ARGS`` would."""
    print(
        f"steadytrain.warm: {why}; starting cold (the imports are paid now)",
        file=sys.stderr,
        flush=True,
    )
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def _end_like(code: int) -> None:
    """End as the worker ended: its exit status, or killed by its signal. A SIGKILL too:
    torchrun's agent reports the worker's ``exitcode: -9`` (and a report reads it as a kill),
    not an exit status 137 that only looks like one."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0 and -code != signal.SIGSTOP:  # a stop is no end: never reported as one
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)  # a signal that did not end this process


def ask(path: str, script: str, args: Sequence[str]) -> tuple[socket.socket, int]:
    """Connect to the warm process at ``path`` and have it fork the worker: the connection
    (open while the worker lives) and the worker's pid. ``OSError`` when none answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(30.0)  # a warm process that accepts but never answers
        sock.connect(path)
        request = {
            "argv": [script, *args],
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "umask": os.umask(0o022),
        }
        os.umask(request["umask"])
        sys.stdout.flush()
        sys.stderr.flush()
        protocol.send(sock, request, [0, 1, 2])
        reply, _ = protocol.recv(sock)
        if reply is None or "pid" not in reply:
            raise OSError(f"the warm process refused: {(reply or {}).get('error', 'closed')}")
        sock.settimeout(None)
        return sock, int(reply["pid"])
    except BaseException:
        sock.close()
        raise


def main(argv: Sequence[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: torchrun ... -m steadytrain.warm.enter SCRIPT.py [ARGS...]")
    script, args = os.path.abspath(argv[0]), list(argv[1:])
    path = os.environ.get(protocol.ENV_SOCKET)
    if not path:
        return _cold(script, args, f"{protocol.ENV_SOCKET} is not set")
    worker: list[int] = []  # the worker's pid, once the warm process forked it
    pending: list[int] = []  # signals that came before that: delivered once it exists

    def forward(sig: int, _frame: object) -> None:
        if not worker:
            pending.append(sig)
            return
        try:
            os.kill(worker[0], sig)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:  # before the request: a SIGTERM at once still reaches the worker
        signal.signal(sig, forward)
    try:
        sock, pid = ask(path, script, args)
    except (OSError, ValueError) as e:
        for sig in _FORWARDED:
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )
        if pending:  # stopped while asking: end as that signal would have
            _end_like(-pending[0])
        return _cold(script, args, f"no warm process at {path} ({e})")
    worker.append(pid)
    for sig in pending:
        forward(sig, None)
    code = _worker_end(sock, pid)
    if code is None:  # the warm process died: its workers with it
        print(f"steadytrain.warm: the warm process at {path} went away", file=sys.stderr)
        _end_like(1)
    _end_like(code)


def _worker_end(sock: socket.socket, pid: int) -> int | None:
    """How the worker ended (an exit status, or minus its signal); None: the warm process
    went away first. The warm process reports every end once it has reaped the worker; a
    worker killed by a signal is also seen here at once, through a pidfd (readable when the
    worker ends, its parent or not) and its zombie's ``exit_code`` in ``/proc``: under load
    the warm process can be scheduled after the killed rank's peers have failed and
    torchrun's agent has reported them as the first failure (seen at load ~23)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except OSError:  # already reaped, or no pidfd here (Linux < 5.3): the report alone
        pidfd = None
    try:
        while True:
            ready, _, _ = select.select([sock, *([pidfd] if pidfd is not None else [])], [], [])
            if sock in ready:
                reply, _ = protocol.recv(sock)
                return None if reply is None or "exit" not in reply else int(reply["exit"])
            assert pidfd is not None
            os.close(pidfd)
            pidfd = None
            code = _zombie_signal(pid)
            if code is not None:
                return code
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _zombie_signal(pid: int) -> int | None:
    """Minus the signal that ended ``pid``, read from its zombie (``/proc/PID/stat``'s
    ``exit_code``, field 52); None when it is no zombie (reaped already), or ended by an exit
    (the warm process's report is exact for those, and a 0 may be ``/proc`` hiding it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 50 or fields[0] != "Z":
        return None
    status = int(fields[49])
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else None


if __name__ == "__main__":
    main(sys.argv[1:])
