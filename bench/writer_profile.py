"""Where the thread-mode checkpoint writer's time goes (issue 13, interference).

Saves the state of ``bench/interference.py`` (its tiny GPT, AdamW, ``--ballast-mib`` of
extra tensors) with thread-mode ``Checkpointer``s and measures the writer thread
(``Checkpointer._run``) per save: wall time, and its CPU split by the kernel's per-thread
accounting (``getrusage(RUSAGE_THREAD)``) into user time (Python, pickling, hashing: the
part that holds the GIL the training thread needs, an upper bound) and system time (the
bytes copied into the page cache, fsync: the GIL released). Three writers, their saves
interleaved in rotating order, the first ``--warmup`` saves of each left out:

- ``torch_save``: DCP's ``torch.save`` archive per tensor (``tensor_format="torch_save"``);
- ``raw_planned``: raw tensor records, DCP planning every save (``reuse_plans=False``);
- ``raw_reused``: the default: raw records, and the saves that repeat a layout written
  from DCP's earlier plan (``repeat_save.py``).

Then a pass under cProfile of the default names the functions (its own overhead inflates
Python time, so the summary comes from the first pass).

    .venv/bin/python bench/writer_profile.py [--saves 8] [--ballast-mib 64]

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


WRITERS = {
    "torch_save": {"tensor_format": "torch_save"},
    "raw_planned": {"reuse_plans": False},
    "raw_reused": {},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--saves", type=int, default=8, help="measured saves per writer")
    p.add_argument("--warmup", type=int, default=2, help="saves per writer before them")
    p.add_argument("--ballast-mib", type=int, default=64)
    p.add_argument("--out", default=os.path.join(HERE, "results", "writer_profile.json"))
    args = p.parse_args()

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

    prof = cProfile.Profile()
    run, mode = C.Checkpointer._run, ["warmup"]
    per_save: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WRITERS}
    plans: dict[str, list[str]] = {w: [] for w in WRITERS}

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
                per_save[self.bench_name].append((time.perf_counter() - t0, user, system))

    C.Checkpointer._run = measured
    names = list(WRITERS)
    with tempfile.TemporaryDirectory(prefix="writer-profile-") as tmp:
        cks = {}
        for w, kw in WRITERS.items():
            cks[w] = Checkpointer(
                os.path.join(tmp, w), every_steps=0, keep_last=2, async_mode="thread",
                on_event=lambda e, w=w: plans[w].append(e.get("plan", "")), **kw,
            )  # fmt: skip
            cks[w].bench_name = w
        try:
            step = 0
            for r in range(args.warmup + args.saves):
                mode[0] = "warmup" if r < args.warmup else "measure"
                for w in names[r % len(names) :] + names[: r % len(names)]:
                    step += 1
                    cks[w].save(step, states)
                    cks[w].wait()
                    cks[w].maybe_save(0, states)  # delivers the event
            mode[0] = "profile"
            for _ in range(args.saves):
                step += 1
                cks["raw_reused"].save(step, states)
                cks["raw_reused"].wait()
            items = _items(os.path.join(tmp, "raw_reused"))
        finally:
            for ck in cks.values():
                ck.close()
            C.Checkpointer._run = run

    def spread_ms(w: str, i: int) -> dict[str, float]:
        xs = [1e3 * s[i] for s in per_save[w]]
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}

    doc = {
        "benchmark": "writer_profile",
        "command": "python bench/writer_profile.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "dcp_items_per_save": items,
        "saves": args.saves,
        "writers": {
            w: {
                "settings": WRITERS[w],
                "plans": plans[w][args.warmup :],
                "per_save": [{"wall_s": a, "user_s": u, "system_s": s} for a, u, s in per_save[w]],
                "wall_ms": spread_ms(w, 0),
                # Python, pickling, hashing: holds the GIL (upper bound)
                "user_ms": spread_ms(w, 1),
                "system_ms": spread_ms(w, 2),  # the kernel's copies and fsync: GIL released
            }
            for w in names
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[bench] {items} DCP items a save; medians (min-max) of {args.saves} saves each:")
    for w in names:
        d = doc["writers"][w]
        print(
            f"  {w:12s} wall {d['wall_ms']['median']:6.1f} ms | user CPU "
            f"{d['user_ms']['median']:5.1f} ms ({d['user_ms']['min']:.1f}-"
            f"{d['user_ms']['max']:.1f}) | system {d['system_ms']['median']:5.1f} ms | "
            f"plans {sorted(set(d['plans']))}"
        )
    print(f"[bench] wrote {args.out}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def _items(root: str) -> int:
    """Records in the newest checkpoint under ``root`` (DCP's ``.metadata``)."""
    import pickle

    newest = max(d for d in os.listdir(root) if d.startswith("step-"))
    with open(os.path.join(root, newest, ".metadata"), "rb") as f:
        return len(pickle.load(f).storage_data)


if __name__ == "__main__":
    main()
