"""The warm process and torchrun's entry into it (steadytrain.warm), with real processes and
a real socket, no torchrun: a worker forked from the warm interpreter runs the script with
the entry's arguments, environment, directory and streams, without importing its modules
again; signals and exits pass through both ways; without a warm process the entry runs cold.
The node-loss measurement is bench/spare_warm.py's (the node harness)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from steadytrain.errors import ConfigError
from steadytrain.testing import forkserver
from steadytrain.warm.server import listen

pytestmark = pytest.mark.timeout(300)

SRC = str(Path(__file__).resolve().parents[2] / "src")

# The script's own module: it appends a line to IMPORTS each time it is imported, so the
# file shows who imported it (the warm process once, a cold start again).
MARKER = """
import os
with open(os.environ["IMPORTS"], "a") as f:
    f.write(f"marker {os.getpid()}\\n")
"""
# A package that loads a name on first use (PEP 562), as ``from steadytrain import Run`` does.
LAZY_INIT = """
def __getattr__(name):
    import importlib
    return importlib.import_module("warm_lazy." + name)
"""
LAZY_THING = MARKER.replace("marker", "lazy")
SCRIPT = """
import os, signal, sys, time
import warm_marker
from warm_lazy import thing
from steadytrain import Run  # as a training script has it: the warm process preloads it
what = sys.argv[1]
if what == "birth":
    from steadytrain import run
    with open(os.environ["OUT"][:-4] + ".birth", "w") as f:
        f.write(f"{run.PROCESS_START} {run.IMPORTED_AT}")
    what = "0"
if what == "threads":  # torch's intra-op threads, as torchrun's OMP_NUM_THREADS asked
    import torch
    with open(os.environ["OUT"][:-4] + ".threads", "w") as f:
        f.write(str(torch.get_num_threads()))
    what = "0"
with open(os.environ["OUT"] + ".tmp", "w") as f:  # whole or not at all: the test polls it
    f.write(f"{os.getpid()} {os.getcwd()} {os.environ.get('ASKED')} {' '.join(sys.argv[1:])}")
os.replace(os.environ["OUT"] + ".tmp", os.environ["OUT"])
print("worker says hi", flush=True)
if what == "sleep":
    time.sleep(900)  # far past any wait below: only a kill ends it in time
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "raise":
    sys.excepthook = lambda *a: open(os.environ["OUT"] + ".hook", "w").write(a[0].__name__)
    raise ValueError("uncaught")
if what == "atexit":
    import atexit
    atexit.register(lambda: open(os.environ["OUT"] + ".atexit", "w").write("ran"))
    what = "3"
sys.exit(int(what))
"""


LONG_POLL = (
    "import sys; import steadytrain.warm.server as s; s.POLL_S = 3600.0; s.main(sys.argv[1:])"
)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", **extra}


def _until(pred, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def _serving(root: Path, script: str, **env: str) -> Iterator[dict]:
    """A warm process for ``root/script``, its socket under ``root/run``, stopped at the end."""
    sock = root / "run" / "warm.sock"
    log = open(root / "server.log", "w")  # noqa: SIM115
    # An hour between polls: the loop must wake by itself for a worker's end (an entry
    # learns of a SIGKILL before the survivors' errors reach torchrun) and for SIGTERM.
    server = subprocess.Popen(
        [sys.executable, "-c", LONG_POLL, "--socket", str(sock), str(root / script)],
        env=_env(**env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _until(lambda: sock.exists() or server.poll() is not None, "the warm process")
        assert server.poll() is None, (root / "server.log").read_text()
        yield {"root": root, "sock": str(sock), "server": server}
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    (root / "warm_marker.py").write_text(MARKER)
    (root / "warm_lazy").mkdir()
    (root / "warm_lazy" / "__init__.py").write_text(LAZY_INIT)
    (root / "warm_lazy" / "thing.py").write_text(LAZY_THING)
    (root / "job.py").write_text(SCRIPT)
    imports = root / "imports.txt"
    # the warm process runs 3 intra-op threads; each entry asks for 1 (``_env``)
    with _serving(root, "job.py", IMPORTS=str(imports), OMP_NUM_THREADS="3") as w:
        yield {**w, "imports": imports}


def enter(warm, *args: str, sock: str | None = None, **kw) -> subprocess.Popen:
    out = warm["root"] / f"out-{time.monotonic_ns()}.txt"
    p = subprocess.Popen(
        [sys.executable, "-m", "steadytrain.warm.enter", str(warm["root"] / "job.py"), *args],
        env=_env(
            STEADYTRAIN_WARM_SOCKET=sock or warm["sock"],
            IMPORTS=str(warm["imports"]),
            OUT=str(out),
            ASKED="by-the-entry",
        ),
        cwd=str(warm["root"] / "run"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )
    p.out = out  # type: ignore[attr-defined]
    return p


def test_worker_runs_the_entrys_request_without_importing_again(warm):
    p = enter(warm, "7")
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 7, stderr  # the worker's exit status is the entry's
    assert "worker says hi" in stdout  # the entry's own stdout, handed to the worker
    pid, cwd, asked, args = p.out.read_text().split(" ", 3)
    assert int(pid) != p.pid and cwd == str(warm["root"] / "run")
    assert asked == "by-the-entry" and args == "7"  # the entry's environment and argv
    # the script's modules were imported once, by the warm process, not by the worker: the
    # plain import, and the name a package loads on first use
    server = warm["server"].pid
    assert warm["imports"].read_text().splitlines() == [f"marker {server}", f"lazy {server}"]
    assert "starting cold" not in stderr


def test_a_worker_runs_the_threads_its_own_environment_asks_for(warm):
    """torchrun sets OMP_NUM_THREADS=1 for each worker of a multi-rank node; the warm
    process, started by hand, has its own count (3 here): a forked worker must take the
    worker's, as a fresh interpreter reads it at start, or every rank of the node runs as
    many threads as the warm process (oversubscribed cores)."""
    p = enter(warm, "threads")
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert p.out.with_suffix(".threads").read_text() == "1"


def test_sigterm_reaches_the_worker_and_the_entry_ends_by_it(warm):
    p = enter(warm, "sleep")
    _until(lambda: p.out.exists(), "the worker to start")
    worker = int(p.out.read_text().split()[0])
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == -signal.SIGTERM
    _until(lambda: not _alive(worker), "the worker to end")


def test_a_sigkilled_worker_ends_its_entry_by_sigkill(warm):
    """torchrun's agent reports ``exitcode: -9`` for the SIGKILLed rank as for a fresh one
    (an exit status 137 would read as an exit, not a kill)."""
    p = enter(warm, "kill")
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, stderr
    assert int(p.out.read_text().split()[0]) != p.pid  # the forked worker was killed


def test_a_sigkilled_workers_entry_ends_without_waiting_for_the_warm_process(warm):
    """The entry sees its worker's SIGKILL itself: with the warm process stopped (scheduled
    late, under load) it still ends by SIGKILL, before its peers' errors reach torchrun."""
    p = enter(warm, "sleep")
    _until(lambda: p.out.exists(), "the worker to start")
    worker = int(p.out.read_text().split()[0])
    server = warm["server"].pid
    os.kill(server, signal.SIGSTOP)
    try:
        os.kill(worker, signal.SIGKILL)
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        os.kill(server, signal.SIGCONT)
    _until(lambda: not _alive(worker), "the worker to be reaped")


def test_the_workers_atexit_handlers_run_as_in_a_fresh_interpreter(warm):
    """A worker ends as a fresh interpreter does, its ``atexit`` handlers run (where
    steadytrain's ledger records a job's end), then with its own exit status."""
    p = enter(warm, "atexit")
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 3, stderr
    assert p.out.with_suffix(".txt.atexit").read_text() == "ran"


def test_an_uncaught_exception_goes_through_the_scripts_excepthook(warm):
    """As in a fresh interpreter: the script's ``sys.excepthook`` sees it (steadytrain's
    trainer hooks record a crash's reason there), and the worker exits with status 1."""
    p = enter(warm, "raise")
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 1, stderr
    assert p.out.with_suffix(".txt.hook").read_text() == "ValueError"


def test_a_killed_entry_takes_its_worker_with_it(warm):
    p = enter(warm, "sleep")
    _until(lambda: p.out.exists(), "the worker to start")
    worker = int(p.out.read_text().split()[0])
    p.kill()  # torchrun's SIGKILL after its grace: the warm process must end the worker
    p.wait(timeout=60)
    _until(lambda: not _alive(worker), "the worker to be killed")
    assert warm["server"].poll() is None  # and stays warm for the next restart


def test_without_a_warm_process_the_entry_runs_cold(warm):
    p = enter(warm, "3", sock=str(warm["root"] / "nobody.sock"))
    _, stderr = p.communicate(timeout=240)
    assert p.returncode == 3
    assert "no warm process at" in stderr and "starting cold" in stderr
    pid = p.out.read_text().split()[0]
    assert int(pid) == p.pid  # it ran in the entry itself
    assert f"lazy {pid}" in warm["imports"].read_text().splitlines()  # and paid the imports


def test_a_request_for_another_script_is_refused_and_runs_cold(warm, tmp_path):
    other = warm["root"] / "other.py"
    other.write_text("import sys; sys.exit(5)\n")
    p = subprocess.Popen(
        [sys.executable, "-m", "steadytrain.warm.enter", str(other)],
        env=_env(STEADYTRAIN_WARM_SOCKET=warm["sock"]),
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 5
    assert "refused" in stderr and "runs " + str(warm["root"] / "job.py") in stderr


def test_listen_refuses_a_shared_directory_and_a_foreign_file(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="not writable by others"):
        listen(str(shared / "warm.sock"))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "warm.sock").write_text("not a socket")
    with pytest.raises(ConfigError, match="is not a socket of this user's: remove it"):
        listen(str(private / "warm.sock"))
    assert (private / "warm.sock").read_text() == "not a socket"  # nothing of it lost


def test_cli_refuses_a_shared_socket_directory(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    script = tmp_path / "job.py"
    script.write_text("print('never run')\n")
    # Forked from the fork server: the refusal is what is checked, not the CLI's start-up.
    r = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "warm", "--socket", str(shared / "w.sock"),
         str(script)],
        env=_env(), timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert f"steadytrain warm: error: {shared}" in r.stderr and "mode 0700" in r.stderr
    assert not (shared / "w.sock").exists()


def test_a_workers_start_up_counts_from_its_fork(warm):
    """``steadytrain.run`` (preloaded: the script's ``from warm_lazy import thing`` pattern
    is how a script gets ``Run``) dates the process's birth as it is imported; a worker's
    must be its fork, or its start-up would hold the warm process's whole idle time."""
    import steadytrain.run  # noqa: F401 - the same module the warm process preloaded
    from steadytrain.run_birth import process_start

    t0 = process_start()  # this process: born before the entry below, by construction
    time.sleep(0.05)
    t_ask = time.time()
    p = enter(warm, "birth")
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    born, imported = (float(x) for x in p.out.with_suffix(".birth").read_text().split())
    # /proc dates the birth to a clock tick (10 ms): allow one on both sides (CI: the import
    # mark 1.1 ms before a birth rounded up)
    assert born >= t_ask - 0.01 and imported >= born - 0.01
    assert born > t0


LIGHTNING_SCRIPT = """
import os
from lightning.fabric.utilities.rank_zero import rank_zero_only
with open(os.environ["OUT"], "w") as f:
    f.write(str(rank_zero_only.rank))
"""


def test_lightnings_rank_is_the_workers_not_the_warm_processs(tmp_path):
    """Lightning sets ``rank_zero_only.rank`` from RANK as it is imported: in the warm
    process, where no rank exists. A forked rank 1 must see 1 (as a fresh one does), or a
    ``@rank_zero_only`` function called before the strategy sets it runs on every rank."""
    if importlib.util.find_spec("lightning") is None:  # looked up: importing it costs seconds
        pytest.skip("lightning is not installed")
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "pl.py").write_text(LIGHTNING_SCRIPT)
    with _serving(tmp_path, "pl.py") as w:
        for rank in ("1", "0"):
            out = tmp_path / f"rank{rank}.txt"
            r = subprocess.run(
                [sys.executable, "-m", "steadytrain.warm.enter", str(tmp_path / "pl.py")],
                env=_env(STEADYTRAIN_WARM_SOCKET=w["sock"], OUT=str(out), RANK=rank),
                capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert "starting cold" not in r.stderr  # forked from the warm process
            assert out.read_text() == rank
