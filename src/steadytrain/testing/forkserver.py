"""Python processes forked from one interpreter that imported torch once (a fork server).

Most of what the suite's processes cost is the interpreter importing torch (and DCP): 3-5
s of CPU each on a 2-core machine, and the suite starts hundreds of them. A server,
started once per test process, imports those modules (``PRELOAD``), takes one
optimizer step (torch imports much of itself on first use), stays single-threaded, and
forks each process from there. The child is a process of its own (its own pid, sockets,
memory, files; a SIGKILL ends it alone) that runs ``python SCRIPT ARGS``, ``python -m
MODULE ARGS`` or ``python -c CODE ARGS`` with the arguments, environment and working
directory a fresh interpreter would have had, and exits the way one does (threads joined,
atexit, stdio and open files flushed, the exit status of ``SystemExit``, 1 after a traceback
through ``sys.excepthook``, SIGINT after an uncaught KeyboardInterrupt), then ``os._exit``:
the teardown it skips would copy the server's pages (``_end``).

What a fork cannot give, so a test that depends on it starts a fresh Python instead:

- what happens at start-up or import (``import steadytrain`` staying light, a module that
  reads the environment as it is imported: a preloaded module read the server's);
- a hash seed of its own: forked processes share the server's, so an order that differs
  between ranks only through ``PYTHONHASHSEED`` is for fresh processes to catch (the
  torchrun tests; ``STEADYTRAIN_TEST_FRESH=1`` makes every ``popen``/``run`` here fresh).

torchrun's agent (``python -m torch.distributed.run``) is forked all the same: its own
start-up and hash seed are nothing a test checks, and the ranks it starts stay fresh
interpreters (the agent starts them with ``subprocess``). Its output may go to a file the
caller opened (``stdout=``/``stderr=``, as ``subprocess`` takes them).

Protocol on a Unix socket pair: the client sends one JSON line ``{"argv", "env", "cwd",
"umask"}`` with the fds the child's stdout and stderr become (``SCM_RIGHTS``; one fd when
they are the same: a pipe's write end, or a file the caller opened); the server answers
``{"pid"}``, and ``{"exit": pid, "code": returncode}`` when that child ends (negative: the
signal, as ``subprocess``). The end of the socket ends the server, which SIGKILLs the
children still running.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any, NoReturn

__all__ = [
    "PRELOAD",
    "ForkedProcess",
    "Forkserver",
    "NodeEntryFailed",
    "forks",
    "popen",
    "python_argv",
    "run",
]

# What the server imports before it forks: the bulk of any torch process's start-up. Not
# steadytrain (0.3 s more once torch is in): a stock reader checks that it never imports it.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
)
_MAX_MSG = 1 << 20
# Where a child's stdout or stderr goes, as ``subprocess`` takes it: ``PIPE``, ``STDOUT``
# (stderr only), a file object or an fd.
Output = int | IO[Any]


# -- server ---------------------------------------------------------------------------------


def _warm_up(preload: Sequence[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 8)).sum().backward()
    optim.step()


def _main(argv: list[str]) -> None:
    """Run ``argv`` (what follows ``python``) as ``__main__``, as the interpreter would."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        code = compile(argv[1], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _node_entry() -> Any:
    """``steadytrain/testing/node_entry.py``, loaded by its path: the server must not import
    the steadytrain package. Loaded once, before the first fork, so children inherit it."""
    import importlib.util

    name = "_steadytrain_node_entry"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_entry.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _enter_node(node: list[Any], r: int, w: int) -> list[str]:
    """In the forked child, first: enter the node (``node_entry.enter(NETNS, CGROUP_VIEW)``)
    and close ``w``, the pipe the server waits on; a failure is written there (the server
    answers it as the request's error) and ends the child with 126, before it ran anything."""
    os.close(r)
    try:
        notes = _node_entry().enter(*node)
    except BaseException as e:  # noqa: BLE001 - any failure: the child must not run
        with contextlib.suppress(OSError):
            os.write(w, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(126)
    os.close(w)
    return notes


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return data


def _become(msg: dict[str, Any], fds: list[int], notes: Sequence[str] = ()) -> int:
    """In the forked child: become the process asked for, run it; its exit code (negative:
    the signal it must end by). The caller then ends it as a fresh interpreter ends
    (``_end``). ``notes``: lines for its stderr first (what entering its node warned)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGPIPE stays ignored, as
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Python sets it; SIGCHLD was never set
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)
    for fd in {null, *fds}:
        os.close(fd)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    os.environ.clear()
    os.environ.update(msg["env"])
    os.chdir(msg["cwd"])
    if msg.get("umask") is not None:
        os.umask(msg["umask"])
    # A fresh interpreter seeds torch's and numpy's global generators from the OS; a fork
    # would share the server's state with every sibling (``random`` reseeds itself).
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        _main(msg["argv"])
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF  # what exit(3) leaves of it: sys.exit(-1) is 255
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - reported as a fresh Python reports it:
        sys.excepthook(type(e), e, e.__traceback__)  # through the script's hook, if it set one
        # and an uncaught KeyboardInterrupt ends the process by SIGINT (Py_RunMain)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _end(code: int) -> NoReturn:
    """End the forked child as a fresh interpreter ends (``Py_FinalizeEx``), without its
    teardown. What anyone can see of an end is done here: non-daemon threads joined,
    ``atexit`` handlers run, stdout and stderr flushed (a failed flush ends with 120, as
    ``Py_RunMain`` does), every file object still open flushed (one a script left in a
    global is flushed only by the teardown), then the status: ``code``, or the signal when
    ``code`` is negative (an uncaught KeyboardInterrupt: SIGINT). What is skipped, module
    teardown and the final collection, touches every object the child inherited and so
    copies the server's pages: ~0.4 s of CPU per child even with ``gc.freeze()``. Skipped
    with it: ``__del__`` of objects alive at the end (a fresh interpreter does not promise
    to run them either)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as Py_FinalizeEx does
    except Exception:  # noqa: BLE001 - the handlers below still run
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
    atexit._run_exitfuncs()  # prints a handler's exception, as at a fresh interpreter's end
    if not _flush_std():
        code = 120
    _flush_files()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code  # the signal did not end it (a thread blocks it): as CPython does
    os._exit(code)


def _flush_std() -> bool:
    """``flush_std_files`` of CPython: False when stdout or stderr could not be flushed."""
    ok = True
    for stream in (sys.stdout, sys.stderr):
        if stream is None or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - stderr's failure is silent, as in CPython
            ok = False
            if stream is sys.stdout:
                _unraisable(f"Exception ignored in: {stream!r}")
    return ok


def _unraisable(header: str) -> None:
    import traceback

    with contextlib.suppress(Exception):
        print(header, file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()


def _flush_files() -> None:
    """Flush the file objects the child made and left open. ``gc.get_objects`` lists only
    the child's own (the server's are frozen), so the server's pages stay shared."""
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    files = [o for o in gc.get_objects() if isinstance(o, kinds)]
    files.sort(key=lambda f: not isinstance(f, io.TextIOWrapper))  # text first: into buffers
    for f in files:
        with contextlib.suppress(Exception):  # closed, read-only, a dead pipe
            if not f.closed and f.writable():
                f.flush()


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One request (a JSON line) and the fds sent with it; b"" when the client is gone."""
    data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 2)
    while data and not data.endswith(b"\n"):
        more = sock.recv(_MAX_MSG)
        if not more:
            return b"", fds
        data += more
    return data, fds


def serve(sock: socket.socket, preload: Sequence[str]) -> None:
    """The server's loop (``python .../forkserver.py FD MODULE,...``)."""
    _warm_up(preload)
    _node_entry()
    # Everything the preload made is frozen: never collected, so neither a child's
    # collections nor its exit walk it, and the pages a fork shares stay shared. Without it
    # the exit of a forked `python -c pass` cost 0.77 s of CPU here (the final collection and
    # module teardown write to every preloaded object, copying each page), with it 0.27 s;
    # every rank and CLI call the suite forks pays that once.
    gc.freeze()
    children: set[int] = set()

    def reply(msg: dict[str, Any]) -> None:
        sock.sendall(json.dumps(msg).encode() + b"\n")

    while True:
        while children:  # report every child that ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not select.select([sock], [], [], 0.02)[0]:
            continue
        data, fds = _receive(sock)
        if not data:  # the client is gone: so are its children
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        req = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        node = req.get("node")
        r, w = os.pipe() if node else (-1, -1)
        pid = os.fork()
        if pid == 0:
            sock.close()
            notes = _enter_node(node, r, w) if node else []
            _end(_become(req, fds, notes))
        error = ""
        if node:  # the child has entered its node (EOF) or said why not (milliseconds)
            os.close(w)
            error = _read_all(r).decode(errors="replace")
            os.close(r)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        reply({"pid": pid, "id": req.get("id"), "error": error})


# -- client ---------------------------------------------------------------------------------


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class NodeEntryFailed(RuntimeError):
    """A child forked for a node could not enter the node's namespaces (it did not run)."""


class _Pipe:
    """A child's output, read as it comes (a full pipe must never block the child)."""

    def __init__(self, fd: int) -> None:
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        with open(fd, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


class ForkedProcess:
    """A forked child, with the ``subprocess.Popen`` calls tests use: ``pid``, ``poll``,
    ``wait``, ``communicate`` (text; None for a stream that is not a pipe of its own, e.g.
    stderr sharing stdout's pipe, or a file), ``send_signal``, ``kill``, ``returncode``."""

    def __init__(
        self, server: Forkserver, pid: int, out: _Pipe | None, err: _Pipe | None, args: list[str]
    ) -> None:
        self.pid, self.args, self.returncode = pid, args, None
        self._server, self._out, self._err = server, out, err
        self._pipes = [p for p in (out, err) if p is not None]

    def poll(self) -> int | None:
        self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.exit_code(self.pid, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = code
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        for p in self._pipes:  # a child of the child may still hold a pipe open
            p.thread.join(timeout)
            if p.thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        out, err = (p.text() if p else None for p in (self._out, self._err))
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forkserver:
    """The client of one server: starts it (its imports and warm-up: seconds, once) and
    forks processes from it."""

    def __init__(self, preload: Sequence[str]) -> None:
        self._sock, theirs = socket.socketpair()
        fd = theirs.fileno()
        self._proc = subprocess.Popen(
            # By its path, not `-m`: the server must not import the steadytrain package (a
            # stock reader checks that it never does; a child imports what it needs).
            [sys.executable, os.path.abspath(__file__), str(fd), ",".join(preload)],
            pass_fds=[fd],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        theirs.close()
        self.closed = False
        self._exits: dict[int, int] = {}
        # Each request's pid by the request's id: a caller interrupted while it waits (a
        # test's timeout) leaves its pid unclaimed, and the next caller must not take it (it
        # did: every later process of the test process got its predecessor's pid and exit).
        self._pids: dict[int, int] = {}
        self._errors: dict[int, str] = {}  # a request's child that could not enter its node
        self._abandoned: set[int] = set()  # requests whose caller stopped waiting
        self._next_id = 0
        self._cond = threading.Condition()
        self._send = threading.Lock()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        buf = b""
        while chunk := self._sock.recv(65536):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                with self._cond:
                    if "exit" in msg:
                        self._exits[msg["exit"]] = msg["code"]
                    elif msg["id"] in self._abandoned:  # nobody holds it: it must not run
                        self._abandoned.discard(msg["id"])
                        _kill(msg["pid"])
                    else:
                        self._pids[msg["id"]] = msg["pid"]
                        if msg.get("error"):
                            self._errors[msg["id"]] = msg["error"]
                    self._cond.notify_all()
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def popen(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None = None,
        *,
        merge: bool = True,
        umask: int | None = None,
        stdout: Output = subprocess.PIPE,
        stderr: Output | None = None,
        node: tuple[str, str | None] | None = None,
    ) -> ForkedProcess:
        """Fork ``python *argv`` with exactly ``env``. ``stdout``: a pipe (``PIPE``) or a
        file object or fd the child writes to; ``stderr``: the same choices or ``STDOUT``,
        by default ``STDOUT`` with ``merge`` and a pipe of its own without. ``node``:
        ``(NETNS, CGROUP_VIEW or None)``, the node harness's node the child enters before it
        runs (``node_entry``); ``NodeEntryFailed`` when it could not."""
        if stderr is None:
            stderr = subprocess.STDOUT if merge else subprocess.PIPE
        made: list[tuple[int, int]] = []  # (read, write) of the pipes made here

        def child_fd(target: Output) -> int:
            if target == subprocess.PIPE:
                made.append(os.pipe())
                return made[-1][1]
            if isinstance(target, int) and target < 0:  # DEVNULL, or STDOUT for stdout
                raise ValueError(f"a forked child's output goes to PIPE, a file or an fd: {target}")
            return target if isinstance(target, int) else target.fileno()

        out_fd = child_fd(stdout)
        send = [out_fd] if stderr == subprocess.STDOUT else [out_fd, child_fd(stderr)]
        with self._send:
            rid = self._next_id
            self._next_id += 1
            req = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "umask": umask, "id": rid}
            if node is not None:
                req["node"] = list(node)
            try:
                socket.send_fds(self._sock, [json.dumps(req).encode() + b"\n"], send)
            finally:
                for _, w in made:  # the child holds its own copies; the caller's files stay
                    os.close(w)
            try:
                with self._cond:
                    self._cond.wait_for(lambda: rid in self._pids or self.closed, timeout=300)
                    if rid not in self._pids:
                        raise RuntimeError(f"the fork server is gone (exit {self._proc.poll()})")
                    pid = self._pids.pop(rid)
                    error = self._errors.pop(rid, "")
            except BaseException:  # gone, or interrupted: no child is left running unheld
                with self._cond:
                    if rid in self._pids:
                        _kill(self._pids.pop(rid))
                    else:
                        self._abandoned.add(rid)
                for r, _ in made:
                    os.close(r)
                raise
        if error:  # the child ended (126) before it ran anything
            for r, _ in made:
                os.close(r)
            assert node is not None
            raise NodeEntryFailed(
                f"a process forked for node namespace {node[0]} could not enter it, so it "
                f"did not run ({error}); {' '.join(argv[:3])}. Run as root where `ip netns "
                "exec` works, or with STEADYTRAIN_TEST_FRESH=1"
            )
        reads = iter(_Pipe(r) for r, _ in made)
        out = next(reads) if stdout == subprocess.PIPE else None
        err = next(reads) if stderr == subprocess.PIPE else None
        return ForkedProcess(self, pid, out, err, argv)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self.closed, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_SERVER: Forkserver | None = None
_LOCK = threading.Lock()


def python_argv(cmd: Sequence[str]) -> list[str] | None:
    """What follows ``python`` in ``cmd``, when a fork can run it: ``[sys.executable,
    SCRIPT | -m MODULE | -c CODE, ...]`` or the ``steadytrain`` console script next to
    ``sys.executable``; None for anything else (interpreter flags, another program)."""
    exe, rest = cmd[0], list(cmd[1:])
    if exe == sys.executable:
        if rest and (rest[0] in ("-m", "-c") and len(rest) > 1 or not rest[0].startswith("-")):
            return rest
        return None
    if exe == os.path.join(os.path.dirname(sys.executable), "steadytrain"):
        return ["-m", "steadytrain.cli", *rest]
    return None


def forks(cmd: Sequence[str]) -> bool:
    """Whether ``popen(cmd)`` forks: a Python command line ``python_argv`` can run, and no
    ``STEADYTRAIN_TEST_FRESH=1`` in this process's environment."""
    return python_argv(cmd) is not None and os.environ.get("STEADYTRAIN_TEST_FRESH") != "1"


def popen(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    merge: bool = True,
    umask: int | None = None,
    stdout: Output = subprocess.PIPE,
    stderr: Output | None = None,
    node: tuple[str, str | None] | None = None,
) -> ForkedProcess | subprocess.Popen:
    """``subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, umask=umask)``
    (``stderr`` by default ``STDOUT`` with ``merge``, else ``PIPE``), forked from this
    process's server (started at the first call, closed at exit) when ``forks(cmd)``; a
    fresh process otherwise. ``node``: the harness node ``(NETNS, CGROUP_VIEW)`` the child
    enters (``Forkserver.popen``); only a fork can (the harness starts a fresh process
    there through ``ip netns exec``), so ``ValueError`` when ``cmd`` would run fresh."""
    env = dict(os.environ if env is None else env)
    if stderr is None:
        stderr = subprocess.STDOUT if merge else subprocess.PIPE
    argv = python_argv(cmd)
    if not forks(cmd):
        if node is not None:
            raise ValueError(f"{list(cmd)[:3]} runs fresh here: start it on node {node[0]} "
                             "with `ip netns exec` (NodeHarness.popen does)")  # fmt: skip
        return subprocess.Popen(
            list(cmd), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=True,
            umask=-1 if umask is None else umask,
        )  # fmt: skip
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.closed:
            _SERVER = Forkserver(PRELOAD)
            atexit.register(_SERVER.close)
        server = _SERVER
    assert argv is not None
    proc = server.popen(argv, env, cwd, umask=umask, stdout=stdout, stderr=stderr, node=node)
    proc.args = list(cmd)  # what subprocess.Popen would name in TimeoutExpired
    return proc


def run(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    umask: int | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` through ``popen``."""
    proc = popen(cmd, env=env, cwd=cwd, merge=False, umask=umask)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err or "")


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not this file's directory (its modules are steadytrain's)
    serve(socket.socket(fileno=int(sys.argv[1])), [m for m in sys.argv[2].split(",") if m])
