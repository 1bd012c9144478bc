"""What the default checkpoint format costs a user who needs stock tools, and what it saves.

The default ``tensor_format="raw"`` makes every save cheaper for the training loop (the
writer thread holds the GIL for less Python: ``bench/writer_profile.py``) but DCP's stock
reader refuses it, so such a user runs ``steadytrain export`` once per checkpoint they hand
over. This benchmark puts both on one state, the one ``writer_profile.py`` saves (the tiny
GPT of ``bench/interference.py``, with ``--ballast-mib`` of large parameters added to it,
and AdamW's moments of every parameter):

- per save, both formats, thread mode, saves interleaved: the writer thread's wall time and
  user CPU (``getrusage(RUSAGE_THREAD)``: Python, pickling, hashing; an upper bound on the
  GIL it holds) -- what a run pays on every save;
- once, the default checkpoint (model, AdamW moments) exported with ``export_checkpoint`` (the library call behind
  ``steadytrain export``) to each of ``dcp``, ``torch`` and ``safetensors``: wall seconds and
  MB/s (verification included) -- what a user pays per checkpoint they hand over;
- the baseline: stock ``dcp_to_torch_save`` of the ``torch_save``-format checkpoint, what a
  user of that format runs instead of ``--to torch``.

    .venv/bin/python bench/export_cost.py [--saves 4] [--ballast-mib 128]

Writes bench/results/export_cost.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FORMATS = {"raw": {}, "torch_save": {"tensor_format": "torch_save"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--saves", type=int, default=4, help="measured saves per format")
    p.add_argument("--ballast-mib", type=int, default=128, help="MiB of large parameters added")
    p.add_argument("--out", default=os.path.join(HERE, "results", "export_cost.json"))
    args = p.parse_args()

    import torch

    from interference import ACCUM, MICRO, SEQ, Trainer
    from steadytrain.checkpoint import checkpointer as C
    from steadytrain.checkpoint.checkpointer import Checkpointer
    from steadytrain.checkpoint.export import export_checkpoint

    torch.set_num_threads(1)
    trainer = Trainer()
    # A realistic shape: the model's weights plus AdamW's two moments of each (the export
    # to safetensors writes the first third). The ballast joins the model as parameters.
    for i in range(8):
        w = torch.randn(args.ballast_mib * (1 << 20) // 32)
        trainer.model.register_parameter(f"ballast{i}", torch.nn.Parameter(w))
    trainer.optim = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, 257, (MICRO, SEQ))
    batches = iter(lambda: {"input_ids": x, "labels": x}, None)
    for _ in range(ACCUM):
        trainer.step(batches)
    for p in trainer.model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    trainer.optim.step()  # every parameter has its moments now
    states = {"model": trainer.model, "optim": trainer.optim}

    run, per_save = C.Checkpointer._run, {f: [] for f in FORMATS}
    measuring = [False]

    def measured(self, req):  # the writer thread's whole job for one save
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        try:
            return run(self, req)
        finally:
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            if measuring[0]:
                per_save[self.bench_name].append(
                    (
                        time.perf_counter() - t0,
                        r1.ru_utime - r0.ru_utime,
                        r1.ru_stime - r0.ru_stime,
                    )
                )

    C.Checkpointer._run = measured
    exports: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="export-cost-") as tmp:
        cks = {}
        for f, kw in FORMATS.items():
            cks[f] = Checkpointer(os.path.join(tmp, f), keep_last=2, async_mode="thread", **kw)
            cks[f].bench_name = f
        try:
            step = 0
            for r in range(1 + args.saves):  # the first save of each is DCP-planned: warm-up
                measuring[0] = r > 0
                for f in list(FORMATS)[r % 2 :] + list(FORMATS)[: r % 2]:
                    step += 1
                    cks[f].save(step, states)
                    cks[f].wait()
        finally:
            for ck in cks.values():
                ck.close()
            C.Checkpointer._run = run
        root = os.path.join(tmp, "raw")
        size = _newest_size(root)
        for to in ("dcp", "torch", "safetensors"):
            t0 = time.perf_counter()
            res = export_checkpoint(root, to, os.path.join(tmp, f"export-{to}"))
            wall = time.perf_counter() - t0
            exports[to] = {"wall_s": wall, "out_bytes": res["bytes"], "tensors": res["tensors"]}
        # The baseline: what a torch_save-format user runs instead of ``--to torch``.
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        ts = os.path.join(tmp, "torch_save")
        t0 = time.perf_counter()
        dcp_to_torch_save(os.path.join(ts, _newest(ts)), os.path.join(tmp, "baseline.pt"))
        baseline_s = time.perf_counter() - t0

    saves = {
        f: {
            "per_save": [{"wall_s": w, "user_s": u, "system_s": k} for w, u, k in per_save[f]],
            "wall_ms": 1e3 * statistics.median(w for w, _, _ in per_save[f]),
            "user_ms": 1e3 * statistics.median(u for _, u, _ in per_save[f]),
            "system_ms": 1e3 * statistics.median(k for _, _, k in per_save[f]),
        }
        for f in FORMATS
    }
    saved_ms = saves["torch_save"]["user_ms"] - saves["raw"]["user_ms"]
    doc = {
        "benchmark": "export_cost",
        "command": "python bench/export_cost.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "checkpoint_bytes": size,
        "saves": saves,
        "writer_user_ms_saved_per_save": saved_ms,
        "baseline_dcp_to_torch_save_of_torch_save_format_s": baseline_s,
        "exports": {
            to: e | {"mb_per_s": size / 1e6 / e["wall_s"], "saves_to_repay": _repay(e, saved_ms)}
            for to, e in exports.items()
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[bench] checkpoint {size / 2**20:.0f} MiB; medians of {args.saves} saves per format:")
    for f, s in saves.items():
        print(
            f"  save {f:10s} writer wall {s['wall_ms']:6.1f} ms, user CPU {s['user_ms']:5.1f} "
            f"ms, system CPU {s['system_ms']:5.1f} ms"
        )
    for to, e in doc["exports"].items():
        print(
            f"  export --to {to:11s} {e['wall_s']:5.2f} s ({e['mb_per_s']:.0f} MB/s); the "
            f"writer CPU raw saves on {e['saves_to_repay']} saves"
        )
    print(f"  baseline: dcp_to_torch_save of the torch_save-format checkpoint {baseline_s:.2f} s")
    print(f"[bench] wrote {args.out}")


def _repay(e: dict, saved_ms: float) -> int | None:
    """Saves whose writer-CPU saving adds up to one export's wall time."""
    return round(1e3 * e["wall_s"] / saved_ms) if saved_ms > 0 else None


def _newest(root: str) -> str:
    return max(d for d in os.listdir(root) if d.startswith("step-"))


def _newest_size(root: str) -> int:
    d = os.path.join(root, _newest(root))
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))


if __name__ == "__main__":
    main()
