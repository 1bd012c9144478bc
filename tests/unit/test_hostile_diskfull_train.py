"""Issue 25: a real ``steadytrain train`` whose run directory (a tmpfs) is full from the first
step until step 6, checkpoints elsewhere, ``train.trace`` on (the default). Before the fix
``StepTrace.write`` raised a raw ``OSError`` at step 1; now every step trains, and the ledger,
the rank file and the trace hold every step once space returns."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e", "train"))
sys.path.insert(0, os.path.dirname(__file__))

from harness import BASE_SETTINGS, effective, make_dataset, read_trace  # noqa: E402
from test_hostile_diskfull import fill, mount_tmpfs, unmount  # noqa: E402

from steadytrain.monitor.ledger import read_ledger  # noqa: E402
from steadytrain.testing import forkserver  # noqa: E402

pytestmark = pytest.mark.timeout(180)

STEPS = 12
STALL = "[fault] rank 0: data read of step 6 stalls"


def test_train_goes_on_while_the_run_directory_is_full(tmp_path) -> None:
    ds = make_dataset(str(tmp_path / "ds"), max_bytes=50_000)
    run = str(tmp_path / f"run-{uuid.uuid4().hex[:6]}")
    faults = os.path.join(run, "faults")
    mount_tmpfs(run, "2m")
    try:
        # The fault injector's markers live on their own small disk: the stall that gives
        # this test its moment to free space must not need the full one.
        mount_tmpfs(faults, "64k")
        try:
            filler = fill(run)
            cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
            settings = [*BASE_SETTINGS, f"run_dir={run}", f"data.dataset={ds}",
                        f"checkpoint.dir={tmp_path / 'ckpt'}", f"train.max_steps={STEPS}",
                        "train.log_every=1"]  # fmt: skip
            for s in settings:
                cmd += ["--set", s]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       STEADYTRAIN_FAULTS="slow_read_at_steps=6;slow_read_s=4")  # fmt: skip
            # Forked from the fork server (torch imported once per test process, not per
            # run); its stderr goes to a file read as it grows.
            err_path = tmp_path / "train.err"
            with open(err_path, "w") as err_file:
                proc = forkserver.popen(cmd, env=env, stderr=err_file)
            deadline = time.monotonic() + 150
            while STALL not in err_path.read_text():
                assert proc.poll() is None, err_path.read_text()[-3000:]
                assert time.monotonic() < deadline, err_path.read_text()[-3000:]
                time.sleep(0.05)
            trace_now = os.path.join(run, "trace-rank0.jsonl")
            # Steps 1..5 trained on a full disk: none of them could be written yet.
            assert not os.path.exists(trace_now) or os.path.getsize(trace_now) == 0
            os.unlink(filler)  # space returns during step 6's stall
            rc = proc.wait(timeout=150)
            err = err_path.read_text()
            assert rc == 0, err[-3000:]
            assert "Traceback" not in err, err[-3000:]
            assert "write failed (ENOSPC" in err and "writing works again" in err
            want = list(range(1, STEPS + 1))
            ledger = os.path.join(run, "ledger.jsonl")
            assert [r["step"] for r in read_ledger(ledger) if r["type"] == "step"] == want
            assert not [r for r in read_ledger(ledger) if r["type"] == "records_lost"]
            ranks = os.path.join(run, "ranks", "rank-00000.jsonl")
            assert [r["step"] for r in read_ledger(ranks) if r["type"] == "rank_step"] == want
            assert sorted(effective(read_trace(run))) == want  # the trace: every step once
            with open(os.path.join(run, "final.json")) as f:
                assert json.load(f)["step"] == STEPS
            rep = forkserver.run(  # only the JSON's numbers are read: no plots drawn
                [sys.executable, "-m", "steadytrain.cli", "report", run, "--json",
                 "--out", str(tmp_path / "rep"), "--no-plots"],
                timeout=120,
            )  # fmt: skip
            assert rep.returncode == 0, rep.stderr[-3000:]
            doc = json.loads(rep.stdout)
            assert doc["records_lost"] == [] and doc["steps_kept"] == STEPS
            assert doc["goodput"] > 0
        finally:
            unmount(faults)
    finally:
        unmount(run)
