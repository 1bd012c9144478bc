"""CPU of one torchrun launch, its agent fresh or forked from the suite's fork server.

    python bench/forked_agent.py [--launches 6] [--rounds 2]

Each launch is ``python -m torch.distributed.run --nproc-per-node=2`` of a rank script that
imports nothing and exits, so what is counted is the agent (and its two trivial ranks,
the same in both). Fresh and forked launches alternate, one after the other; the CPU of a
launch is the user + system time of its whole tree, read from this process's reaped
children (``RUSAGE_CHILDREN``, fresh) or from the agent's own ``/proc`` entry with its
reaped ranks (forked: the agent is the fork server's child, not ours), so the one-time
start of the server (its imports and warm-up, paid once per test process) is reported
apart. No test asserts these numbers: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

from steadytrain.testing import forkserver

RANK = "import os; open(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').close()\n"


def _cmd(script: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--max-restarts=0", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    return [*cmd, "--monitor-interval=0.2", script]


def _fresh(cmd: list[str], env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _tree_cpu(pid: int) -> float:
    """User + system seconds of ``pid`` and of the children it reaped (``/proc/PID/stat``
    fields 14-17), read while it is a zombie: after its end, before its parent reaps it."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _forked(cmd: list[str], env: dict[str, str]) -> float:
    # The agent is the fork server's child: its CPU (with the ranks it reaped) is read from
    # its /proc entry every 10 ms until it is gone; the last read misses at most its last
    # few milliseconds (it reaps its ranks before it exits), a small undercount.
    proc = forkserver.popen(cmd, env=env, merge=True)
    last = 0.0
    while True:
        try:
            last = _tree_cpu(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out or "")[-3000:]
    return last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(RANK)
        env = dict(os.environ, OMP_NUM_THREADS="1", OUT=tmp)
        cmd = _cmd(script)
        t0 = time.monotonic()
        forkserver.run([sys.executable, "-c", "pass"], timeout=600)  # the server's start
        print(f"fork server start: {time.monotonic() - t0:.1f} s wall", flush=True)
        fresh: list[float] = []
        forked: list[float] = []
        for _ in range(a.rounds):
            for _ in range(a.launches):
                fresh.append(_fresh(cmd, env))
                forked.append(_forked(cmd, env))
        load = os.getloadavg()[0]
    print(f"launches: {len(fresh)} fresh, {len(forked)} forked, interleaved; load {load:.1f}")
    for name, xs in (("fresh", fresh), ("forked", forked)):
        xs = sorted(xs)
        print(
            f"{name:7s} CPU per launch: median {xs[len(xs) // 2]:.2f} s, {xs[0]:.2f}-{xs[-1]:.2f}"
        )


if __name__ == "__main__":
    main()
