"""What a survivor sees when its peer dies or stops mid-step (issue 44 section 2, measured first).

    python bench/inplace_detect.py [--timeout-s 5] [--faults kill,stop]

Runs ``torchrun --nproc-per-node 2 --max-restarts 1`` over a small DDP model (gloo, CPU).
Rank 1 sends itself SIGKILL (or SIGSTOP) in the middle of step 5, between its forward and
its backward; rank 0 is then blocked in DDP's gradient all-reduce. Measured, per fault: the
seconds from the fault to the moment rank 0's blocked collective raised, the exception's
type and first line, and whether torchrun's agent then sent rank 0 (healthy, its error
caught, sleeping) SIGTERM: the agent restarts the whole local worker group on one worker's
death, so a survivor's process can only be kept by a process that torchrun watches and
that does not die (the keeper, ``steadytrain.inplace.keeper``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
out, fault, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
rank = int(os.environ["RANK"]); attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
def note(**kw):
    with open(os.path.join(out, f"r{rank}.jsonl"), "a") as f:
        f.write(json.dumps(dict(kw, rank=rank, pid=os.getpid(), attempt=attempt)) + "\n")
if attempt > 0:
    note(event="restarted"); sys.exit(0)
signal.signal(signal.SIGTERM, lambda *a: (note(event="sigterm", t=time.time()), sys.exit(1)))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 9):
    loss = model(torch.randn(16, 256)).square().mean()
    if rank == 1 and step == 5:
        note(event="fault", t=time.time())
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        loss.backward()
    except Exception as e:
        note(event="raised", t=time.time(), type=type(e).__name__, msg=str(e).splitlines()[0][:200])
        time.sleep(20)  # healthy and idle: does torchrun's agent tear it down anyway?
        sys.exit(1)
    opt.step(); opt.zero_grad()
"""


def one(fault: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
        cmd += ["--max-restarts=1", "--monitor-interval=0.1", script, tmp, fault, str(timeout_s)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = proc.communicate(timeout=timeout_s + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        rec = []
        for r in (0, 1):
            path = os.path.join(tmp, f"r{r}.jsonl")
            if os.path.exists(path):
                rec += [json.loads(line) for line in open(path)]
    t_fault = next(r["t"] for r in rec if r["event"] == "fault")
    raised = next((r for r in rec if r["event"] == "raised"), None)
    term = next((r for r in rec if r["event"] == "sigterm" and r["rank"] == 0), None)
    restarted = sorted({r["rank"] for r in rec if r["event"] == "restarted"})
    return {
        "fault": fault,
        "pg_timeout_s": timeout_s,
        "raise_after_s": round(raised["t"] - t_fault, 3) if raised else None,
        "exception": f"{raised['type']}: {raised['msg']}" if raised else None,
        "survivor_sigterm_after_s": round(term["t"] - t_fault, 3) if term else None,
        "ranks_restarted": restarted,
        "torchrun_rc": proc.returncode,
        "log_tail": out.decode(errors="replace").splitlines()[-3:] if not raised else [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--faults", default="kill,stop")
    args = ap.parse_args()
    for fault in args.faults.split(","):
        print(json.dumps(one(fault, args.timeout_s)), flush=True)


if __name__ == "__main__":
    main()
