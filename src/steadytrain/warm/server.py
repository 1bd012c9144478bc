"""The warm process of a node: imports once, forks each worker torchrun asks for.

    python -m steadytrain.warm --socket PATH train.py

Start it with the same environment torchrun's agent will have (``PYTHONPATH``, the
virtual environment): what it imports is what each worker runs with. It preloads and warms
up as ``inplace.keeper`` does (torch, steadytrain, the script's top-level imports, one
optimizer step on one thread), then serves ``protocol.py`` on ``PATH`` in a directory only
its user can enter; a connection from another user is refused. One thread, a ``select``
loop: a fork copies no other thread. Per request it forks a worker, which takes the
entry's environment (whole: nothing of the warm process's own), working directory, umask
and standard streams and runs the script as ``__main__`` (``keeper._become_child``: signal
handlers reset, the generators reseeded from the OS, SIGKILL when the warm process dies).
When a worker ends its entry gets its exit status; when an entry's connection ends first,
its worker gets SIGKILL. SIGTERM or SIGINT stop the warm process (its workers with it:
stop it after the job), at once: once its socket is gone and its workers are killed it
leaves with ``os._exit`` (it holds no buffered file; finalizing torch and the preloaded
modules took ~1 s of CPU and 2.5-3.9 s of wall time at load ~6, seconds more on a busy
node, while its agent or a test's teardown waited).
"""

from __future__ import annotations

import logging
import os
import runpy
import select
import signal
import socket
import stat
import sys
import types
from collections.abc import Sequence
from typing import NoReturn

from steadytrain.errors import ConfigError
from steadytrain.inplace.keeper import _become_child, _preload, _warm_up, foreign_threads
from steadytrain.warm import protocol

__all__ = ["check_path", "listen", "serve", "serve_then_exit"]

POLL_S = 0.1  # a fallback only: a worker's end, a request and a signal wake the loop at once

log = logging.getLogger("steadytrain.warm")


def check_path(path: str) -> None:
    """Refuse a socket path another user could reach or has put something at (before the
    preload: a wrong path fails in a second, not after the imports)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    st = os.stat(parent)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"{parent}: the warm process's socket directory must be this user's and not "
            "writable by others (another user could put a socket there); use a private "
            "directory, e.g. one under $XDG_RUNTIME_DIR or the node's local disk, mode 0700"
        )
    try:
        old = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(old.st_mode) or old.st_uid != os.getuid():
        raise ConfigError(f"{path} exists and is not a socket of this user's: remove it")


def listen(path: str) -> socket.socket:
    """A ``SOCK_SEQPACKET`` socket at ``path``, readable by this user only; a stale socket
    of this user's is replaced, anything else at ``path`` is refused (``check_path``)."""
    check_path(path)
    if os.path.lexists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def _peer_uid(conn: socket.socket) -> int:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _reborn() -> None:
    """In the worker: its start-up counts from the fork, not from the warm process's birth.
    ``steadytrain.run`` takes the process's birth and the end of its imports as it is
    imported -- here once, in the warm process, minutes or hours before this worker -- so a
    preloaded copy would book all that time as the worker's start-up (and the restart's
    relaunch and imports as its build). The worker was born now, with its imports done."""
    import time

    from steadytrain.run_birth import process_start

    run = sys.modules.get("steadytrain.run")
    if run is not None:
        run.PROCESS_START = process_start()  # the fork, from /proc
        run.IMPORTED_AT = time.time()
    hooks = sys.modules.get("steadytrain.integrations.hooks")  # holds a copy of the birth
    if hooks is not None and run is not None:
        hooks.PROCESS_START = run.PROCESS_START
    _reread_rank()
    _threads_as_asked()


def _threads_as_asked() -> None:
    """In the worker, its environment in place: torch's intra-op threads as its own
    ``OMP_NUM_THREADS`` asks (torchrun sets 1 for each worker of a multi-rank node), which a
    fresh interpreter reads as torch starts. The warm process's count was fixed by the warm
    process's environment; unset in the worker's, the worker keeps that count."""
    torch = sys.modules.get("torch")
    asked = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and asked.isdigit() and int(asked) > 0:
        torch.set_num_threads(int(asked))


# Lightning's rank_zero module: it sets ``rank_zero_only.rank`` from RANK/LOCAL_RANK/... as
# it is imported (under either of its package names).
_LIGHTNING_RANK_ZERO = (
    "lightning.fabric.utilities.rank_zero",
    "lightning_fabric.utilities.rank_zero",
)


def _reread_rank() -> None:
    """In the worker, its environment in place: Lightning's ``rank_zero_only.rank`` as a
    fresh import would have set it. The warm process imported Lightning before any rank
    existed, so every forked rank would otherwise hold rank 0 until a strategy sets the
    rank, and a ``@rank_zero_only`` function called before the ``Trainer`` or ``Fabric``
    (a directory made, a config written, a logger started) would run on every rank."""
    for name in _LIGHTNING_RANK_ZERO:
        module = sys.modules.get(name)
        if module is None:
            continue
        try:
            module.rank_zero_only.rank = module._get_rank() or 0
        except Exception as e:  # noqa: BLE001 - another Lightning: say so, run the job
            print(f"steadytrain.warm: could not reset {name}'s rank: {e}", file=sys.stderr)


def _fork_worker(
    conn: socket.socket, script: str, others: list[socket.socket], wake: tuple[int, int]
) -> int | None:
    """Read one request from ``conn`` and fork its worker; its pid (None: refused).
    ``others``: the warm process's other sockets, which the worker closes (it must not hold
    the listener or another entry's connection); ``wake``: the loop's wakeup pipe, which
    the worker closes after giving SIGCHLD back its default."""
    try:
        req, fds = protocol.recv(conn, maxfds=3)
    except (OSError, ValueError) as e:
        log.warning("steadytrain.warm: a bad request (%s): refused", e)
        return None
    if req is None:
        return None
    argv = req.get("argv")
    if (
        len(fds) != 3
        or not isinstance(argv, list)
        or not argv
        or os.path.abspath(str(argv[0])) != script
        or not isinstance(req.get("env"), dict)
    ):
        for fd in fds:
            os.close(fd)
        protocol.send(conn, {"error": f"this warm process runs {script} only, with 3 streams"})
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in wake:
                os.close(fd)
            for s in (conn, *others):
                s.close()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            os.chdir(req["cwd"])
            os.umask(int(req["umask"]))
            os.environ.clear()
            os.environ.update(req["env"])  # before _reborn: it reads the rank from it
            _reborn()
            _uncaught_through_excepthook()
            code = _become_child(script, [str(a) for a in argv[1:]], req["env"], me)
            _finalize()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    protocol.send(conn, {"pid": pid})
    return pid


def _run_path(path: str, run_name: str) -> dict:
    """``runpy.run_path``, with an uncaught exception reported as a fresh interpreter
    reports it: through ``sys.excepthook`` (where steadytrain's trainer hooks record the
    crash's reason), then exit status 1."""
    try:
        return runpy.run_path(path, run_name=run_name)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - what `python SCRIPT` does with it
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None


def _uncaught_through_excepthook() -> None:
    """In the worker: an uncaught exception goes through the script's ``sys.excepthook``
    (an HF Trainer's exception was booked as "the process exited before Trainer.train()
    ended" when it did not), then status 1. The keeper's ``_become_child`` (shared with
    ``inplace.keeper``) now does the first itself, but ends an uncaught KeyboardInterrupt
    by SIGINT (a negative code), which this worker's ``os._exit`` does not take: so the
    worker keeps its own runner. Only this forked process's view of the keeper changes."""
    from steadytrain.inplace import keeper

    keeper.runpy = types.SimpleNamespace(run_path=_run_path)  # type: ignore[attr-defined]


def _finalize() -> None:
    """In the worker, its script done: what a fresh interpreter does as it ends and
    ``os._exit`` skips -- wait for its non-daemon threads, then run its ``atexit``
    handlers (steadytrain's ledger writes a job's end and flushes its steps there: without
    them a worker that exited through SIGTERM or an exception left no record of it)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as Py_FinalizeEx does
    except Exception as e:  # noqa: BLE001 - the handlers below still run
        print(f"steadytrain.warm: waiting for the worker's threads: {e}", file=sys.stderr)
    atexit._run_exitfuncs()  # prints a handler's exception, as at a fresh interpreter's end


def _touch_names(script: str) -> None:
    """Resolve the names of the script's top-level ``from X import Y``: a package that
    loads ``Y`` on first use (``from steadytrain import Run``, PEP 562) or a submodule
    ``X.Y`` is imported here, not in every worker (the preload imports ``X`` alone)."""
    import ast
    import importlib

    with open(script, "rb") as f:
        tree = ast.parse(f.read(), filename=script)
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        module = sys.modules.get(node.module)
        for alias in node.names:
            if module is None or alias.name == "*":
                continue
            try:
                getattr(module, alias.name)
            except AttributeError:
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except Exception as e:  # noqa: BLE001 - the worker imports it and says why
                    log.debug("steadytrain.warm: could not preload %s.%s: %s", node.module,
                              alias.name, e)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - as above
                log.debug("steadytrain.warm: could not preload %s: %s", alias.name, e)


def serve(path: str, script: str) -> None:
    """Preload for ``script``, then serve ``path`` until SIGTERM/SIGINT."""
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise ConfigError(f"steadytrain.warm: no script at {script}")
    check_path(path)
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it, for the preload too
    _preload(script)
    _touch_names(script)
    _warm_up()
    if threads := foreign_threads():
        print(
            f"steadytrain.warm: the script's imports started threads ({', '.join(threads)}); "
            "each worker is forked without them. If one hangs at start, import that module "
            "inside the script's main() instead",
            file=sys.stderr,
            flush=True,
        )
    listener = listen(path)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: stop.append(s))
    # A worker's end and a signal wake the loop at once through the wakeup pipe: a SIGKILLed
    # worker's entry must end by SIGKILL before its survivors' errors reach torchrun's agent,
    # which reports the first failure it sees (a 0.1 s poll lost that race under load).
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # a handler: the pipe is written
    signal.set_wakeup_fd(wake[1])
    workers: dict[socket.socket, int] = {}  # an entry's connection -> its worker
    print(f"steadytrain.warm: ready at {path} for {script}", file=sys.stderr, flush=True)
    try:
        while not stop:
            try:
                ready, _, _ = select.select([listener, wake[0], *workers], [], [], POLL_S)
            except InterruptedError:
                continue
            for s in ready:
                if s is listener:
                    conn, _ = listener.accept()
                    if _peer_uid(conn) != os.getuid():
                        conn.close()  # another user's process: never run its request
                        continue
                    pid = _fork_worker(conn, script, [listener, *workers], wake)
                    if pid is None:
                        conn.close()
                    else:
                        workers[conn] = pid
                elif s == wake[0]:
                    _drain(wake[0])
                else:  # the entry's end closed while its worker runs: torchrun killed it
                    _kill(workers.pop(s))
                    s.close()
            _reap(workers)
    finally:
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        for pid in workers.values():
            _kill(pid)


def serve_then_exit(path: str, script: str) -> NoReturn:
    """``serve``, then leave at once (the module docstring says why): the entry points'."""
    serve(path, script)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(workers: dict[socket.socket, int]) -> None:
    """Tell each entry whose worker ended how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for conn, p in list(workers.items()):
            if p == pid:
                del workers[conn]
                try:
                    protocol.send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()


def main(argv: Sequence[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m steadytrain.warm",
        description="A node's warm process: imports SCRIPT's modules once and forks each "
        "worker torchrun starts with -m steadytrain.warm.enter (docs/operations.md).",
    )
    p.add_argument("--socket", required=True, help="the Unix socket (in a private directory)")
    p.add_argument("script")
    a = p.parse_args(argv)
    try:
        serve_then_exit(a.socket, a.script)
    except ConfigError as e:
        raise SystemExit(f"steadytrain.warm: {e}") from None
