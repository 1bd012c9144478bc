"""Where the thread-mode checkpoint writer's time goes (issue 13, interference).

Saves the state of ``bench/interference.py`` (its tiny GPT, AdamW, ``--ballast-mib`` of
extra tensors) with a thread-mode ``Checkpointer`` and measures the writer thread
(``Checkpointer._run``) per save: wall time, and its CPU split by the kernel's per-thread
accounting (``getrusage(RUSAGE_THREAD)``) into user time (Python, pickling, hashing: the
part that holds the GIL the training thread needs, an upper bound) and system time (the
bytes copied into the page cache, fsync: the GIL released). Then a second pass under
cProfile names the functions (its own overhead inflates Python time, so the summary comes
from the first pass). The first ``--warmup`` saves are left out.

    .venv/bin/python bench/writer_profile.py [--saves 6] [--ballast-mib 64]

Prints a summary and the top functions; writes bench/results/writer_profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--saves", type=int, default=6, help="profiled saves")
    p.add_argument("--warmup", type=int, default=2, help="saves before them, not profiled")
    p.add_argument("--ballast-mib", type=int, default=64)
    p.add_argument("--tensor-format", default="raw", choices=["raw", "torch_save"])
    p.add_argument("--out", default=None, help="default: results/writer_profile[_FORMAT].json")
    args = p.parse_args()
    suffix = "" if args.tensor_format == "raw" else f"_{args.tensor_format}"
    args.out = args.out or os.path.join(HERE, "results", f"writer_profile{suffix}.json")

    import torch

    from interference import ACCUM, MICRO, SEQ, Trainer
    from steadytrain.checkpoint import Checkpointer
    from steadytrain.checkpoint import checkpointer as C

    torch.set_num_threads(1)
    trainer = Trainer()
    x = torch.randint(0, 257, (MICRO, SEQ))
    batches = iter(lambda: {"input_ids": x, "labels": x}, None)
    for _ in range(ACCUM):
        trainer.step(batches)  # AdamW's moments exist
    ballast = torch.nn.Module()
    for i in range(8):
        ballast.register_buffer(f"t{i}", torch.randn(args.ballast_mib * (1 << 18) // 8))
    states = {"model": trainer.model, "optim": trainer.optim, "ballast": ballast}

    prof, per_save = cProfile.Profile(), []
    run, mode = C.Checkpointer._run, ["warmup"]

    def measured(self, req):  # the writer thread's whole job for one save
        if mode[0] == "profile":
            prof.enable()
            try:
                return run(self, req)
            finally:
                prof.disable()
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        try:
            return run(self, req)
        finally:
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            if mode[0] == "measure":
                user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
                per_save.append((time.perf_counter() - t0, user, system))

    C.Checkpointer._run = measured
    with tempfile.TemporaryDirectory(prefix="writer-profile-") as tmp:
        ck = Checkpointer(
            tmp, every_steps=0, keep_last=2, async_mode="thread", tensor_format=args.tensor_format
        )
        try:
            plan = ["warmup"] * args.warmup + ["measure"] * args.saves + ["profile"] * args.saves
            for i, m in enumerate(plan):
                mode[0] = m
                ck.save(i + 1, states)
                ck.wait()
        finally:
            ck.close()
            C.Checkpointer._run = run

    st = pstats.Stats(prof)
    # DCP writes one item per tensor (and one per non-tensor value): the per-item cost.
    items = sum(v[0] for k, v in st.stats.items() if k[2] == "resolve_data") // args.saves

    def med(i: int) -> float:
        return statistics.median(s[i] for s in per_save)

    doc = {
        "benchmark": "writer_profile",
        "command": "python bench/writer_profile.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "tensor_format": args.tensor_format,
        "dcp_items_per_save": items,
        "saves": args.saves,
        "per_save": [{"wall_s": w, "user_s": u, "system_s": s} for w, u, s in per_save],
        "wall_s_median": med(0),
        "user_s_median": med(1),  # Python, pickling, hashing: holds the GIL (upper bound)
        "system_s_median": med(2),  # the kernel's copies and fsync: the GIL released
    }
    doc["user_ms_per_item"] = 1e3 * doc["user_s_median"] / max(1, items)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(
        f"[bench] {items} DCP items a save: {1e3 * med(0):.0f} ms on the writer thread, "
        f"{1e3 * med(1):.0f} ms user CPU (holds the GIL; {doc['user_ms_per_item']:.2f} ms "
        f"per item), {1e3 * med(2):.0f} ms system CPU (medians of {args.saves}); "
        f"wrote {args.out}"
    )
    st.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
