"""steadytrain.testing.forkserver: a forked child is the process a fresh ``python`` would
have been (its arguments, environment, working directory, umask, output and exit status),
and what a fork cannot run starts fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from steadytrain.testing import forkserver

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_VALUE"),
        "umask": os.umask(0), "path0": sys.path[0], "name": __name__,
        "steadytrain": "steadytrain" in sys.modules, "pid": os.getpid(),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)


def test_a_forked_script_gets_what_a_fresh_python_would(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, FORKED_VALUE="forty-two")
    cmd = [sys.executable, str(script), "3", "x y"]
    assert forkserver.python_argv(cmd) == [str(script), "3", "x y"]
    out = forkserver.run(cmd, env=env, cwd=str(work), umask=0o027, timeout=120)
    assert out.returncode == 3, out.stderr
    got = json.loads(out.stdout)
    assert got["argv"] == [str(script), "3", "x y"]
    assert got["cwd"] == str(work) and got["env"] == "forty-two"
    assert got["umask"] == 0o027
    assert got["path0"] == str(tmp_path) and got["name"] == "__main__"
    assert not got["steadytrain"], "the server preloaded steadytrain into its children"
    assert got["pid"] != os.getpid()
    assert out.stderr == "to stderr\n"  # its own pipe, not mixed into stdout


def test_two_children_are_two_processes_and_a_traceback_exits_1(tmp_path) -> None:
    pids = set()
    for _ in range(2):
        out = forkserver.run([sys.executable, "-c", "import os; print(os.getpid())"])
        assert out.returncode == 0, out.stderr
        pids.add(int(out.stdout))
    assert len(pids) == 2
    out = forkserver.run([sys.executable, "-c", "raise ValueError('boom')"])
    assert out.returncode == 1 and "ValueError: boom" in out.stderr


def test_a_killed_child_reports_the_signal_and_merged_output_is_one_pipe() -> None:
    proc = forkserver.popen(
        [sys.executable, "-c", "import sys, time; print('up', flush=True); "
         "print('err', file=sys.stderr, flush=True); time.sleep(600)"]
    )  # fmt: skip
    assert isinstance(proc, forkserver.ForkedProcess)
    deadline = time.monotonic() + 120
    while b"err" not in b"".join(proc._pipes[0].chunks) and time.monotonic() < deadline:
        time.sleep(0.05)  # until both lines are out: the kill must not cut them off
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert err is None and "up" in out and "err" in out


def test_what_a_fork_cannot_run_starts_fresh(monkeypatch) -> None:
    assert forkserver.python_argv([sys.executable, "-X", "dev", "-c", "pass"]) is None
    assert forkserver.python_argv(["sh", "-c", "true"]) is None
    cli = os.path.join(os.path.dirname(sys.executable), "steadytrain")
    assert forkserver.python_argv([cli, "report", "x"]) == ["-m", "steadytrain.cli", "report", "x"]
    out = forkserver.run(["sh", "-c", "umask; exit 4"], umask=0o077)
    assert out.returncode == 4 and out.stdout.strip() == "0077"
    monkeypatch.setenv("STEADYTRAIN_TEST_FRESH", "1")
    proc = forkserver.popen([sys.executable, "-c", "pass"])
    assert isinstance(proc, subprocess.Popen)
    proc.communicate(timeout=120)


def test_output_goes_to_the_files_the_caller_opened(tmp_path) -> None:
    both, out_only = tmp_path / "both.log", tmp_path / "out.log"
    code = "import sys; print('out', flush=True); print('err', file=sys.stderr); sys.exit(2)"
    with open(both, "w") as f:  # stdout and stderr into one file (stderr merged, the default)
        proc = forkserver.popen([sys.executable, "-c", code], stdout=f)
        assert proc.wait(timeout=120) == 2
    assert both.read_text().split() == ["out", "err"]
    with open(out_only, "w") as f:  # stdout to a file, stderr to a pipe of its own
        proc = forkserver.popen([sys.executable, "-c", code], stdout=f, merge=False)
        out, err = proc.communicate(timeout=120)
    assert (out, err, proc.returncode) == (None, "err\n", 2)
    assert out_only.read_text() == "out\n"
    with open(out_only, "a") as f:  # an fd, for stderr alone
        proc = forkserver.popen([sys.executable, "-c", code], stderr=f.fileno())
        out, err = proc.communicate(timeout=120)
    assert (out, err) == ("out\n", None) and out_only.read_text() == "out\nerr\n"
    if isinstance(proc, forkserver.ForkedProcess):  # a fresh Popen takes DEVNULL
        with pytest.raises(ValueError, match="PIPE, a file or an fd"):
            forkserver.popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)


def test_a_child_starts_with_the_preloaded_objects_frozen() -> None:
    """The server freezes what its preload made (``gc.freeze``), so a child's collections
    and its exit do not walk, and copy, every preloaded page (0.77 -> 0.27 s of CPU for the
    exit of a forked ``python -c pass`` here); the child's own objects are collected as
    usual."""
    code = "import gc, torch; print(gc.get_freeze_count(), gc.isenabled())"
    r = forkserver.run([sys.executable, "-c", code], timeout=300)
    assert r.returncode == 0, r.stderr
    frozen, enabled = r.stdout.split()
    assert int(frozen) > 10_000 and enabled == "True", r.stdout


# How a script can end, and what a fresh ``python`` makes of each: the forked child must end
# the same way (status, output, files), though it skips the interpreter's teardown.
ENDINGS = {
    "exit code": ("import sys; print('out', end=''); sys.exit(3)", 3),
    "exit -1": ("import sys; sys.exit(-1)", 255),
    "exit 256": ("raise SystemExit(256)", 0),
    "exit message": ("import sys; sys.exit('no input here')", 1),
    "os._exit": ("import os, sys; print('lost', end=''); os._exit(5)", 5),
    "excepthook": (
        "import sys\n"
        "sys.excepthook = lambda t, v, tb: print('hooked', t.__name__, v, file=sys.stderr)\n"
        "raise ValueError('boom')",
        1,
    ),
    "keyboard interrupt": ("raise KeyboardInterrupt", -signal.SIGINT),
    "atexit and a thread": (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "def late():\n"
        "    time.sleep(0.3)\n"
        "    print('thread done', flush=True)\n"
        "threading.Thread(target=late).start()",
        0,
    ),
    "stdout unflushable": (
        "import sys\n"
        "class Full:\n"
        "    def write(self, s): pass\n"
        "    def flush(self): raise OSError('no space left')\n"
        "sys.stdout = Full()",
        120,
    ),
    "atexit raises": ("import atexit; atexit.register(lambda: 1 / 0)", 0),
}


@pytest.mark.parametrize("case", sorted(ENDINGS))
def test_a_forked_child_ends_as_a_fresh_python_does(case, tmp_path) -> None:
    """Exit status, output and a file left open in a global (flushed by a fresh Python's
    teardown, which the forked child skips), fresh and forked side by side."""
    code, status = ENDINGS[case]
    left = "f = open('left-open.txt', 'w'); f.write('written, never flushed')\n"
    runs = {}
    for how in ("fresh", "forked"):
        cwd = tmp_path / how
        cwd.mkdir()
        cmd = [sys.executable, "-c", left + code]
        if how == "fresh":
            r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
        else:
            r = forkserver.run(cmd, cwd=str(cwd), timeout=120)
        saved = (cwd / "left-open.txt").read_text()
        runs[how] = (r.returncode, r.stdout, _last_line(r.stderr), saved)
    assert runs["fresh"][0] == status, runs  # the case itself says what a fresh Python does
    assert runs["forked"] == runs["fresh"]


def _last_line(err: str) -> str:
    """The line that says what ended the process (a traceback's frames differ: the forked
    child runs the code under the server's frames)."""
    lines = err.strip().splitlines()
    return lines[-1] if lines else ""


class _Interrupted(Exception):
    """What pytest-timeout raises in a test's thread: anywhere, e.g. inside ``popen``."""


def test_a_caller_interrupted_in_popen_leaves_the_next_caller_its_own_child() -> None:
    # A test that timed out while its `popen` waited for the server's reply left that pid
    # unclaimed; every later `popen` of the test process then took its predecessor's pid
    # (and reported that process's exit: a torchrun agent whose rank was killed "exited 0").
    server = forkserver.Forkserver([])
    try:
        real, calls = server._cond.wait_for, []

        def interrupted(predicate, timeout=None):  # the first wait: the popen below
            if not calls:
                calls.append(timeout)
                raise _Interrupted
            return real(predicate, timeout)

        server._cond.wait_for = interrupted
        with pytest.raises(_Interrupted):
            server.popen(["-c", "import time; time.sleep(30)"], dict(os.environ))
        proc = server.popen(
            ["-c", "import os, sys; print(os.getpid()); sys.exit(3)"], dict(os.environ)
        )
        out, _ = proc.communicate(timeout=120)
        assert int(out) == proc.pid and proc.returncode == 3, (out, proc.pid)
        # The child nobody holds was killed, not left running.
        deadline = time.monotonic() + 120
        while -signal.SIGKILL not in server._exits.values():
            assert time.monotonic() < deadline, server._exits
            time.sleep(0.05)
    finally:
        server.close()
