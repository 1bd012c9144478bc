"""The integration tests' torchrun workers, forked from a warm process (``steadytrain warm``,
the product's own cure for start-up): most of a small run's CPU is its workers importing
torch, Lightning or transformers, once per rank and attempt. Each test process starts one
warm process per worker script at its first use (``launch``), and ``stop_all`` (the
session fixture in ``conftest.py``) stops them at the end, checking that no worker outlives
its warm process (and ``atexit`` does, for a test outside tests/integrations that uses its
helpers).

``launch(script)`` gives what replaces ``SCRIPT`` on torchrun's command line and the
environment the agent needs: ``-m steadytrain.warm.enter SCRIPT`` with
``STEADYTRAIN_WARM_SOCKET``, or the script alone (fresh workers) with
``STEADYTRAIN_TEST_FRESH=1`` or while its warm process is not listening yet. What a forked worker shares with its siblings, and which
tests stay fresh and why: docs/testing-log.md ("warm workers").
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
from harness import REPO, env, start_agent

FRESH = os.environ.get("STEADYTRAIN_TEST_FRESH") == "1"
# How long a run waits for its warm process to listen (imports and one optimizer step:
# ~10 s for Lightning on a quiet machine, minutes at load 30) before it starts fresh.
READY_S = 60

_servers: dict[str, tuple[subprocess.Popen, str]] = {}  # script -> (warm process, socket)
_root: list[str] = []  # the private socket directory, made at the first use


def _socket_dir() -> str:
    """A private (0700) directory with a short path: a Unix socket path must stay under 108
    bytes, which a pytest tmp path can pass."""
    if not _root:
        _root.append(tempfile.mkdtemp(prefix="st-warm-", dir="/tmp"))
        atexit.register(stop_all)  # a no-op once the session fixture stopped them
    return _root[0]


def _start(script: str) -> tuple[subprocess.Popen, str]:
    """Start the warm process for ``script`` in the background; it listens once it has
    imported what the script imports."""
    root = _socket_dir()
    sock = os.path.join(root, f"{len(_servers)}.sock")
    with open(os.path.join(root, f"{len(_servers)}.log"), "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "steadytrain.warm", "--socket", sock, script],
            env=env(),  # the agent's environment: what a module reads as it is imported
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, sock


def _ready(proc: subprocess.Popen, sock: str, script: str, wait_s: float = READY_S) -> bool:
    """Whether the warm process listens, waiting for it up to ``wait_s``. Not yet (a loaded
    machine, Lightning's imports): this run's workers start fresh, as on main, and the
    test's own timeout is not spent waiting; a later run finds it warm."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(sock):  # bound after the preload: it answers from then on
        if proc.poll() is not None:
            with open(sock[: -len(".sock")] + ".log") as f:
                raise AssertionError(f"the warm process for {script} ended:\n{f.read()}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def prestart(script: str) -> None:
    """Start the warm process for ``script`` now, without waiting for it (nothing with
    ``STEADYTRAIN_TEST_FRESH=1``, nothing if one runs): its preload then overlaps a test's
    set-up, and the first ``launch`` finds it ready sooner."""
    script = os.path.abspath(script)
    if not FRESH and (script not in _servers or _servers[script][0].poll() is not None):
        _servers[script] = _start(script)


def prestart_module(*scripts: str) -> Callable[[], None]:
    """A module-scoped autouse fixture (assign it to a name in the test module) that starts
    the warm processes of ``scripts`` as the module begins: their preloads (Lightning's or
    transformers' imports, ~6-8 s of CPU each) overlap its first test's set-up. Being
    module-scoped, it also keeps the module on one worker of the suite (tests/conftest.py,
    ``unit_of``), so each preload is paid once per run, not by every worker that draws one
    of its tests (in the suite of bf12b28, three workers each paid both preloads of
    test_lightning_callback.py). Name the script of the module's first test: two preloads
    started at once slow each other, and a run whose warm process is not listening within
    ``READY_S`` starts fresh (seen at load ~19: the first test's CPU doubled)."""

    @pytest.fixture(scope="module", autouse=True)
    def warm_module() -> None:
        for script in scripts:
            prestart(script)

    return warm_module


def launch(
    script: str, fresh: bool = False, wait_s: float = READY_S
) -> tuple[list[str], dict[str, str]]:
    """The arguments that run ``script`` in place of ``SCRIPT`` on torchrun's command line
    (or after ``python``), and the environment variables they need (``fresh``: the script
    itself, in a fresh interpreter; so too when its warm process is not listening within
    ``wait_s``)."""
    script = os.path.abspath(script)
    if FRESH or fresh:
        return [script], {}
    prestart(script)
    proc, sock = _servers[script]
    if not _ready(proc, sock, script, wait_s):
        return [script], {}
    return ["-m", "steadytrain.warm.enter", script], {"STEADYTRAIN_WARM_SOCKET": sock}


def stop_all() -> None:
    """SIGTERM each warm process (by its pid), wait for it, and check that none of the
    workers it had forked is left (the warm process SIGKILLs them as it ends)."""
    import psutil

    left: list[str] = []
    for script, (proc, _) in list(_servers.items()):
        try:
            workers = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            workers = []
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        _, alive = psutil.wait_procs(workers, timeout=60)
        for p in alive:
            left.append(f"{p.pid} (forked for {script})")
            p.kill()
        del _servers[script]
    if _root:
        shutil.rmtree(_root.pop(), ignore_errors=True)
    assert not left, f"workers outlived their warm process: {left}"


KEEPER_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper_entry.py")


def keeper(worker: str) -> tuple[list[str], dict[str, str]]:
    """What replaces ``-m steadytrain.inplace.keeper WORKER`` on torchrun's command line, and
    the environment it needs: the keeper forked from the warm process of ``keeper_entry.py``
    (which imports what the keeper and the in-place workers import); main's command line
    with ``STEADYTRAIN_TEST_FRESH=1`` or while that warm process is not listening."""
    entry, warm_env = launch(KEEPER_ENTRY)
    if not warm_env:
        return ["-m", "steadytrain.inplace.keeper", worker], {}
    return [*entry, worker], warm_env


def python(script: str, *args: str, **env_extra: str) -> dict:
    """``subprocess.run``'s ``args`` and ``env`` for ``python SCRIPT ARGS`` (one process, no
    torchrun), the test's environment with ``env_extra``, forked from ``script``'s warm
    process."""
    entry, warm_env = launch(script)
    return {"args": [sys.executable, *entry, *args], "env": {**os.environ, **env_extra, **warm_env}}


def start_inplace(worker: str, *args: str, ranks: int = 2) -> Any:
    """``torchrun`` (``ranks``, ``--max-restarts 1``, c10d) of ``WORKER ARGS`` under the
    keeper (``keeper``), on torchrun's shared store, which the regroup needs; the agent."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    cmd += ["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    entry, warm_env = keeper(worker)  # the keeper, forked from a warm process
    cmd += ["--monitor-interval=0.2", *entry, *args]
    e = env(**warm_env)
    e.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    return start_agent(cmd, e)
