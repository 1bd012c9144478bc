"""GPU check: the parts of steadytrain that only a CUDA machine exercises, in one run.

    .venv/bin/python bench/gpu_check.py                 # everything; ~2-4 min on one node
    .venv/bin/python bench/gpu_check.py --skip-train    # no torchrun (a single-GPU machine)
    .venv/bin/python bench/gpu_check.py --stage-mib 1024 --reps 7

Parts (each one reports ``{"skipped": "<why>"}`` instead of failing when its hardware is
absent, so the same command runs anywhere; on a machine without CUDA it prints
``"cuda": false`` and exits 0):
- ``nccl_resume``: 2-process training on NCCL under the real ``torchrun`` (the reference
  loop, ``steadytrain train demo --set train.device=cuda``), once uninterrupted and once with
  rank 1 killed mid-step through ``STEADYTRAIN_FAULTS`` and restarted by torchrun; final
  weights (the SHA-256 in ``final.json``) and per-step losses must be equal. Needs 2 GPUs.
- ``bf16_autocast``: a few optimizer steps of the small GPT under
  ``torch.autocast("cuda", dtype=torch.bfloat16)``; every loss must be finite.
- ``staging``: ``checkpoint.staging.Stager`` (reused host buffers) copying a GPU state dict
  to the host, against the device-to-host floor (``tensor.to("cpu", non_blocking=True)``
  into preallocated pinned buffers, then one synchronize); median and spread of ``--reps``
  repetitions after a warm-up, and the ratio Stager / floor. Also says whether Stager's
  buffers are pinned: pageable buffers make the copy synchronous and slower.
- ``memory_snapshot``: the memory tier's snapshot of a GPU state (issue 28): the seconds it
  blocks the loop (copies queued on a side stream into pinned, reused buffers) against the
  pinned-copy floor, and that the file holds the values from before the next step's update.
- ``loader_pin_memory``: ``TokenLoader(pin_memory=True, device="cuda")`` vs the same loader
  unpinned, tokens/s delivered onto the GPU and the ratio; checks the batches are equal.

Prints one JSON object; writes bench/results/gpu_check.json only when CUDA was present (a
CPU run records nothing, so a CPU machine never overwrites a GPU result).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(REPO, "bench", "results", "gpu_check.json")

# The e2e tests' tiny model (tests/e2e/train/harness.py): the check is about bits, not speed.
TRAIN_SETTINGS = [
    "seed=7",
    "data.seq_len=64",
    "data.global_batch=8",
    "data.micro_batch=2",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "optim.warmup_steps=4",
    "train.log_every=4",
    "train.deterministic=true",
    "train.device=cuda",
    "checkpoint.interval=steps",
    "checkpoint.every_steps=4",
    "checkpoint.async_mode=thread",
]
TRAIN_STEPS = 20


def _spread(xs: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def make_dataset(dest: str, max_bytes: int = 400_000) -> str:
    """A bytes-tokenized dataset of real text (the standard library's json/ and email/)."""
    import numpy as np

    from steadytrain.data.ingest.writer import DatasetWriter

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "json", "*.py")))
    files += sorted(glob.glob(os.path.join(stdlib, "email", "*.py")))
    total = 0
    tok = {"type": "bytes", "vocab_size": 257, "eos_id": 256}
    with DatasetWriter(dest, vocab_size=257, eos_id=256, tokenizer=tok, shard_tokens=100_000) as w:
        for path in files:
            with open(path, "rb") as f:
                doc = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
            w.add_document(np.append(doc, 256))
            total += doc.size + 1
            if total >= max_bytes:
                break
    return dest


def _torchrun(run_dir: str, dataset: str, faults: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--max-restarts=2", "-m", "steadytrain.cli", "train", "demo"]
    for s in TRAIN_SETTINGS + [
        f"run_dir={run_dir}",
        f"data.dataset={dataset}",
        f"train.max_steps={TRAIN_STEPS}",
    ]:
        cmd += ["--set", s]
    env = dict(os.environ, STEADYTRAIN_FAULTS=faults, PYTHONUNBUFFERED="1")
    # Deterministic cuBLAS (torch.use_deterministic_algorithms refuses it otherwise).
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Restarted workers must not read a stale rendezvous store (pytorch/pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "final.json")) as f:
        return json.load(f)


def _losses(run_dir: str) -> tuple[dict[int, float], int]:
    """The last recorded loss of each step on rank 0 (a redone step overrides its first try)
    and how many attempts wrote them (more than one: the injected crash really happened)."""
    out: dict[int, float] = {}
    attempts = set()
    with open(os.path.join(run_dir, "trace-rank0.jsonl")) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[int(rec["step"])] = rec["loss"]
                attempts.add(rec["attempt_id"])
    return out, len(attempts)


def check_nccl_resume(timeout: float) -> dict[str, Any]:
    if torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, found {torch.cuda.device_count()}"}
    if not torch.distributed.is_nccl_available():
        return {"skipped": "this torch build has no NCCL"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ds = make_dataset(os.path.join(tmp, "ds"))
        t0 = time.perf_counter()
        ref = _torchrun(os.path.join(tmp, "ref"), ds, "", timeout)
        got = _torchrun(os.path.join(tmp, "crash"), ds, "kill_at_steps=10;kill_rank=1", timeout)
        ref_l, _ = _losses(os.path.join(tmp, "ref"))
        got_l, attempts = _losses(os.path.join(tmp, "crash"))
        return {
            "attempts": attempts,
            "steps": TRAIN_STEPS,
            "weights_equal": ref["weights"] == got["weights"],
            "losses_equal": bool(ref_l) and ref_l == got_l,
            "final_step": got["step"],
            "seconds": round(time.perf_counter() - t0, 1),
        }


def check_bf16(steps: int = 5) -> dict[str, Any]:
    from steadytrain.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, seq_len=128, n_layer=2, n_head=4, n_embd=128)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 257, (4, 129), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "steps": steps,
        "losses": losses,
        "finite": all(math.isfinite(v) for v in losses),
        "logits_dtype": str(logits.dtype),
    }


def check_staging(size_mib: int, reps: int) -> dict[str, Any]:
    from steadytrain.checkpoint.staging import Stager

    n = 16  # tensors, as a model's parameters and optimizer moments would be
    per = size_mib * (1 << 20) // n // 4
    state = {f"t{i}": torch.randn(per, device="cuda") for i in range(n)}
    floor_bufs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    stager = Stager()

    def floor() -> None:
        for k, v in state.items():
            floor_bufs[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()

    def staged() -> None:
        stager.stage(state)
        torch.cuda.synchronize()

    floor()
    staged()  # warm-up: allocation happens on the first call only
    t_floor, t_stage = [], []
    for _ in range(reps):  # interleaved, so drift hits both alike
        for fn, out in ((floor, t_floor), (staged, t_stage)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    snap = stager.stage(state)
    equal = all(torch.equal(snap[k], state[k].cpu()) for k in state)
    ratios = [s / f for s, f in zip(t_stage, t_floor, strict=True)]
    gib = size_mib / 1024
    return {
        "mib": size_mib,
        "reps": reps,
        "stager_pinned_buffers": all(b.is_pinned() for b in stager._buffers.values()),
        "copy_equal": equal,
        "floor_s": _spread(t_floor),
        "stager_s": _spread(t_stage),
        "floor_gb_s": gib / statistics.median(t_floor),
        "stager_gb_s": gib / statistics.median(t_stage),
        "ratio_stager_over_floor": _spread(ratios),
    }


def check_memory_snapshot(size_mib: int, reps: int) -> dict[str, Any]:
    """The memory tier's snapshot of a GPU model (issue 28, item 5): what it blocks the loop
    for (the device-to-host copies are queued on a side stream into pinned, reused buffers;
    the background thread waits for them) against the pinned-copy floor (the same bytes,
    ``non_blocking`` into preallocated pinned buffers, then a synchronize: what a snapshot
    that waits for its copy would block). Exactness: the step right after the snapshot
    overwrites every parameter on the training stream, and the snapshot file must still hold
    the values from before it."""
    from steadytrain.checkpoint.memory import snapshot as snap
    from steadytrain.checkpoint.memory.config import MemoryConfig
    from steadytrain.checkpoint.memory.tier import MemoryTier
    from steadytrain.run_identity import new_nonce

    n = 16
    per = size_mib * (1 << 20) // n // 4
    model = torch.nn.ParameterDict(
        {f"p{i}": torch.nn.Parameter(torch.randn(per, device="cuda")) for i in range(n)}
    )
    floor_bufs = [torch.empty(p.shape, pin_memory=True) for p in model.values()]

    def floor() -> None:
        for buf, p in zip(floor_bufs, model.values(), strict=True):
            buf.copy_(p.detach(), non_blocking=True)
        torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as mem:
        tier = MemoryTier(MemoryConfig(every_steps=1, dir=mem), None, mem, "gpu-check")
        tier.nonce = new_nonce()  # a snapshot names its run (the Checkpointer sets it)
        states = {"model": model}
        step = 0

        def snapshot() -> None:
            nonlocal step
            step += 1
            tier.snapshot(step, states)  # returns once the copies are queued

        floor()
        snapshot()  # warm-up: buffers are allocated (and pinned) on the first one only
        tier.wait()
        t_floor, t_snap = [], []
        for _ in range(reps):
            for fn, out in ((floor, t_floor), (snapshot, t_snap)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
                tier.wait()
        before = {k: p.detach().clone().cpu() for k, p in model.items()}
        snapshot()
        with torch.no_grad():  # the next optimizer step, queued at once on the training stream
            for p in model.values():
                p.add_(1.0)
        tier.wait()
        events = tier.take_events()
        path = tier.store.path(0, step)
        _, tree = snap.parse(snap.read_file(path), path)
        held = tree["model"]
        exact = all(torch.equal(held[k], before[k]) for k in before)
        tier.close(remove=True)
    ratios = [s / f for s, f in zip(t_snap, t_floor, strict=True)]
    return {
        "mib": size_mib,
        "reps": reps,
        "floor_s": _spread(t_floor),
        "snapshot_block_s": _spread(t_snap),
        "ratio_snapshot_over_floor": _spread(ratios),
        "snapshot_holds_the_pre_step_values": exact,
        "events_ok": all(e.get("ok") for e in events),
    }


def check_loader(batches: int) -> dict[str, Any]:
    from steadytrain import TokenDataset, TokenLoader

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ds = TokenDataset.open(make_dataset(os.path.join(tmp, "ds"), max_bytes=4_000_000))
        result: dict[str, Any] = {}
        firsts = {}
        for pin in (False, True, False, True):  # interleaved; the second of each is kept
            loader = TokenLoader(ds, seq_len=1024, global_batch=64, micro_batch=8, seed=0,
                                 num_workers=0, pin_memory=pin, device="cuda")  # fmt: skip
            it = iter(loader)
            first = next(it)
            firsts[pin] = first["input_ids"].cpu()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = 0
            for _ in range(batches):
                b = next(it)
                tokens += b["input_ids"].numel()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            result["pinned" if pin else "unpinned"] = {
                "m_tokens_s": tokens / dt / 1e6,
                "on_device": str(b["input_ids"].device),
            }
            close = getattr(loader, "close", None)
            if close is not None:
                close()
        result["ratio_pinned_over_unpinned"] = (
            result["pinned"]["m_tokens_s"] / result["unpinned"]["m_tokens_s"]
        )
        result["same_batches"] = torch.equal(firsts[True], firsts[False])
        return result


PARTS = ("nccl_resume", "bf16_autocast", "staging", "memory_snapshot", "loader_pin_memory")


def _run(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as exc:  # one broken part must not hide the others' results
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage-mib", type=int, default=512, help="state size for staging")
    ap.add_argument("--reps", type=int, default=5, help="staging repetitions (median, spread)")
    ap.add_argument("--loader-batches", type=int, default=200)
    ap.add_argument("--skip-train", action="store_true", help="skip the 2-GPU torchrun part")
    ap.add_argument("--train-timeout", type=float, default=300)
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {"cuda": cuda, "torch": torch.__version__}
    if not cuda:
        why = "CUDA is not available on this machine (torch.cuda.is_available() is False)"
        for part in PARTS:
            report[part] = {"skipped": why}
        print(json.dumps(report, indent=2))
        return 0
    report["device"] = torch.cuda.get_device_name(0)
    report["gpus"] = torch.cuda.device_count()
    if args.skip_train:
        report["nccl_resume"] = {"skipped": "--skip-train"}
    else:
        report["nccl_resume"] = _run(check_nccl_resume, args.train_timeout)
    report["bf16_autocast"] = _run(check_bf16)
    report["staging"] = _run(check_staging, args.stage_mib, args.reps)
    report["memory_snapshot"] = _run(check_memory_snapshot, args.stage_mib, args.reps)
    report["loader_pin_memory"] = _run(check_loader, args.loader_batches)
    text = json.dumps(report, indent=2)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
