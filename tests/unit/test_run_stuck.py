"""``run_stuck.StuckExit`` in a real process (the signal, the wakeup fd and the thread are the
parts under test): a main thread whose own SIGTERM handler ran is left alone however long it
then takes (a loop that saves before leaving); one whose handler did not run -- here held
back by blocking the signal in the main thread only, as a C++ call holds it back -- is
recorded and ended with 143 after ``exit_s``; ``exit_s = 0`` watches nothing; and one held
back for less than its ``patience`` (a loop whose steps are that long: ``Run`` gives twice
its longest step) reaches its handler and is left alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, threading
    from steadytrain.run_stuck import StuckExit
    mode, out = sys.argv[1], sys.argv[2]
    seen = []
    signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    def abandon(signum):
        with open(out, "w") as f:
            f.write(f"abandoned {signum}")
    # "long-step": the loop's steps took up to 2.5 s, so 2 x that is the patience
    patience = (lambda: 5.0) if mode == "long-step" else (lambda: 0.0)
    w = StuckExit(0.0 if mode == "off" else 0.5, abandon, reacted=lambda: bool(seen),
                  patience=patience)
    print("watching" if w.start() else "not watching", flush=True)
    if mode in ("stuck", "long-step"):
        # The main thread cannot run its handler (as inside a C++ call): the kernel still
        # runs the C-level one on the watcher's thread, which writes the wakeup fd.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    print("sleeping", flush=True)  # the test sends SIGTERM once this thread is in the call
    # a save after the signal, or a C++ call that never returns; stuck: far past exit_s, so a
    # watcher thread starved of the CPU for seconds (4 test workers on 2 cores) still wins
    time.sleep(30.0 if mode == "stuck" else 3.0)
    print("handler ran" if seen else "handler did not run", flush=True)
    """
)


def _asleep(pid: int) -> bool:
    """The main thread of ``pid`` is blocked (state S), not running bytecode."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def _run_and_signal(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; SIGTERM it once its main thread sleeps in the call. A signal sent by the
    script itself could be handled between two bytecodes before the call began (seen in CI:
    the "stuck" thread's handler ran, exit 0), which no C++ call allows."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = []
    for line in p.stdout:
        first.append(line)
        if line.strip() == "sleeping":
            break
    calm = 0
    while calm < 3 and p.poll() is None:  # three looks 50 ms apart: inside the sleep
        calm = calm + 1 if _asleep(p.pid) else 0
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(argv, p.returncode, "".join(first) + out, err)


@pytest.mark.parametrize("mode", ["reacted", "stuck", "off", "long-step"])
def test_stuck_exit_ends_only_a_main_thread_that_cannot_react(tmp_path, mode: str) -> None:
    script, out = tmp_path / "w.py", tmp_path / "abandoned"
    script.write_text(SCRIPT)
    r = _run_and_signal([sys.executable, str(script), mode, str(out)])
    if mode == "stuck":
        assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stdout, r.stderr)
        assert out.read_text() == f"abandoned {int(signal.SIGTERM)}"
        assert "handler" not in r.stdout  # ended before the "save" finished
        return
    assert r.returncode == 0, r.stderr
    assert not out.exists()
    assert "handler ran" in r.stdout
    assert ("not watching" in r.stdout) == (mode == "off"), r.stdout
