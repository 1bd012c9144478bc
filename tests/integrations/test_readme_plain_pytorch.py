"""The README's plain PyTorch example, extracted and run as written, so it cannot rot.

It must stay 20 lines or fewer, train to step 200 with committed checkpoints, and resume:
with its newest checkpoint removed (as if the job had died before it), a second run
continues from the one before and commits step 200 again, leaving older ones untouched.
Its ``steadytrain.Run`` keeps the ledger: two attempts, the second restored at step 150,
both ended cleanly.

Under torchrun on 2 ranks it is data parallel: each rank's last micro-batch is its own half
of step 200's global batch (together: the global batch a one-rank loader reads at step 200),
and the ranks end with equal weights; with rank 1 SIGKILLed in step 120 (a prelude wraps
``Run.step_done``; the block is unchanged) torchrun restarts it, it resumes from step 100 and
ends with the weights of a run that was not killed. (A plain DDP loop with a killed and a
hung rank: test_run_plain_pytorch.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from example_runs import assert_kill_reported, finish
from harness import env as torchrun_env
from harness import start_agent
from warm_pool import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def readme_block() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    m = re.search(r"^Plain PyTorch, crash-safe.*?```python\n(.*?)```", text, re.S | re.M)
    assert m, "README.md lost its 'Plain PyTorch, crash-safe' example"
    return m.group(1)


def committed(ckpts: str) -> dict[int, float]:
    """Committed step -> mtime of its COMMIT, from `steadytrain checkpoints --json`."""
    out = subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "checkpoints", ckpts, "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)["checkpoints"]
    return {
        r["step"]: os.path.getmtime(os.path.join(r["path"], "COMMIT"))
        for r in rows
        if r["state"] == "committed" and r["verifies"]
    }


def test_readme_plain_pytorch_example_runs_and_resumes(dataset: str, tmp_path) -> None:
    code = readme_block()
    assert len(code.strip().splitlines()) <= 20, "keep the README's example short"
    shutil.copytree(dataset, tmp_path / "my-dataset")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run() -> None:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    run()
    first = committed(str(tmp_path / "ckpts"))
    assert max(first) == 200 and 150 in first, first
    shutil.rmtree(tmp_path / "ckpts" / "step-00000200")
    run()  # resumes from step 150
    second = committed(str(tmp_path / "ckpts"))
    assert max(second) == 200
    assert second[150] == first[150], "step 150 was saved again: the run did not resume"
    from steadytrain.monitor.ledger import read_ledger

    recs = read_ledger(str(tmp_path / "run" / "ledger.jsonl"))
    starts = [r["restored_step"] for r in recs if r["type"] == "job_start"]
    ends = [r["reason"] for r in recs if r["type"] == "job_end"]
    assert starts == [0, 150] and ends == ["finished", "finished"], (starts, ends)
    assert [r["step"] for r in recs if r["type"] == "step"][-1] == 200


# After the block, on every rank: what it read last, and the weights it ended with.
EPILOGUE = """
import hashlib, json, os
digest = hashlib.sha256()
for name, t in sorted(model.state_dict().items()):
    digest.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
with open(f"rank{os.environ['RANK']}.json", "w") as f:
    json.dump({"world": loader.world_size, "last_ids": batch["sample_ids"].tolist(),
               "weights": digest.hexdigest()}, f)
"""

# Before it: in the run whose agent sets KILL_ENV, rank 1 dies in step KILL of the first
# attempt (the README block is not edited). One script for both runs: one warm process.
KILL, KILL_ENV = 120, "README_TEST_KILL"
PRELUDE = f"""
import os, signal, steadytrain
_step_done = steadytrain.Run.step_done
def _killing_step_done(self, step, **kw):
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if os.environ.get("{KILL_ENV}") and first and os.environ.get("RANK") == "1" and step == {KILL}:
        os.kill(os.getpid(), signal.SIGKILL)
    return _step_done(self, step, **kw)
steadytrain.Run.step_done = _killing_step_done
"""


def test_readme_plain_pytorch_is_data_parallel_and_exact_under_torchrun(dataset, tmp_path):
    from steadytrain import TokenDataset, TokenLoader
    from steadytrain.monitor.ledger import read_ledger

    script = tmp_path / "block.py"
    script.write_text(PRELUDE + readme_block() + EPILOGUE)
    # The ranks fork from the script's warm process (the block runs as written, as
    # ``__main__``; test_readme_plain_pytorch_example_runs_and_resumes runs it as a user
    # types it, a fresh ``python``).
    entry, warm_env = launch(str(script))
    procs = {}
    for name, kill in (("ref", {}), ("killed", {KILL_ENV: "1"})):
        (tmp_path / name).mkdir()
        shutil.copytree(dataset, tmp_path / name / "my-dataset")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
        cmd += ["--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
        cmd += ["--monitor-interval=0.2", *entry]
        procs[name] = start_agent(cmd, torchrun_env(**warm_env, **kill), cwd=str(tmp_path / name))
    outs = {name: finish(proc) for name, proc in procs.items()}
    assert_kill_reported(outs["killed"], killed=1)

    def ranks(name: str) -> list[dict]:
        return [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)]

    ref, killed = ranks("ref"), ranks("killed")
    assert [r["world"] for r in ref] == [2, 2]
    # Step 200's global batch, as one rank reads it: the two ranks' halves, in rank order.
    whole = TokenLoader(
        TokenDataset.open(dataset), seq_len=128, global_batch=16, micro_batch=8, labels="next"
    )
    whole.load_state_dict({**whole.state_dict(), "step": 199, "position": 199 * 16})
    step_200 = [i for _ in range(whole.micro_per_step) for i in next(whole)["sample_ids"].tolist()]
    whole.close()
    assert ref[0]["last_ids"] + ref[1]["last_ids"] == step_200
    assert set(ref[0]["last_ids"]).isdisjoint(ref[1]["last_ids"])
    assert ref[0]["weights"] == ref[1]["weights"]  # DDP: one model
    assert [r["weights"] for r in killed] == [ref[0]["weights"]] * 2  # resumed exactly
    recs = read_ledger(str(tmp_path / "killed" / "run" / "ledger.jsonl"))
    starts = [r["restored_step"] for r in recs if r["type"] == "job_start"]
    assert starts == [0, 100], starts
