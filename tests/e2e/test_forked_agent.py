"""torchrun's agent forked from the fork server (``harness.start_agent``, what every
torchrun test of the suite outside the node harness starts): the agent is a forked child,
and the ranks it starts are still fresh interpreters of its own (their own hash seed, torch
not preloaded), whose exit torchrun reports as it does for a fresh agent (a SIGKILLed rank:
``exitcode: -9``, the agent exits 1). Its output can go to a file the test opened."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "train"))

from harness import env, kill_tree, start_agent  # noqa: E402

from steadytrain.testing import forkserver  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# A rank that imports nothing heavy: what it reports is how it was started.
RANK = textwrap.dedent(
    """
    import json, os, signal, sys
    rank = int(os.environ["RANK"])
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "hash": hash("steadytrain"),
                   "torch": "torch" in sys.modules}, f)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_forked_agent_starts_fresh_ranks_and_reports_their_exit(tmp_path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd += ["--max-restarts=0", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    cmd += ["--monitor-interval=0.2", str(script), str(tmp_path)]
    log_path = tmp_path / "agent.log"
    with open(log_path, "w") as log:
        agent = start_agent(cmd, env(), stdout=log)
        try:
            code = agent.wait(timeout=240)
        finally:
            if agent.poll() is None:
                kill_tree(agent)
    log_text = log_path.read_text()
    fresh = os.environ.get("STEADYTRAIN_TEST_FRESH") == "1"
    assert isinstance(agent, subprocess.Popen if fresh else forkserver.ForkedProcess)
    # What a fresh agent does with a SIGKILLed rank: names the signal, exits 1.
    assert code == 1, log_text[-4000:]
    assert f"exitcode: -{int(signal.SIGKILL)}" in log_text, log_text[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["ppid"] for r in ranks] == [agent.pid] * 2  # the agent's own children
    assert not any(r["torch"] for r in ranks), "a rank started with torch preloaded: forked"
    # Each rank drew its own hash seed: none shares the fork server's (nor each other's).
    served = forkserver.run([sys.executable, "-c", "print(hash('steadytrain'))"], timeout=120)
    assert served.returncode == 0, served.stderr
    hashes = {r["hash"] for r in ranks}
    assert len(hashes) == 2 and int(served.stdout) not in hashes, (hashes, served.stdout)
