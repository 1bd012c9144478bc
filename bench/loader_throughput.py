"""Loader throughput: tokens/s and CPU ns/token, global shuffle, seq 2048, micro-batch 8.

Side by side on the same tokens (a 32 Mi-token steadytrain dataset in the page cache):
the numpy memmap window gather (the floor, in uint16 and producing int64 inputs+labels),
steadytrain's TokenLoader with 0 (background thread), 1 and 2 worker processes, and the
peers: torchdata StatefulDataLoader over a Megatron-style map dataset, litdata
StreamingDataset + TokensLoader, mosaicml-streaming MDS, each with 0/1/2 workers. Every
configuration runs in its own process. "Per core" is tokens per CPU-second (all processes
of the configuration), the number that does not depend on how busy the machine is.

    .venv/bin/python bench/loader_throughput.py              -> bench/results/loader_throughput.json
    .venv/bin/python bench/loader_throughput.py --only-ours  -> bench/results/loader_throughput_quick.json

``--only-ours`` runs the two floors and the in-process / background-thread TokenLoader rows
(no peers, no worker processes: about a minute), ``--quick`` adds the worker-process rows;
both write ``loader_throughput_quick.json`` so the full side-by-side result is kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _loader_common import (  # noqa: E402
    PEER_PY,
    STUB_DIR,
    WORK,
    ensure_peer_env,
    make_dataset,
    measure,
    run_json,
    write_result,
)

SEQ, MICRO = 2048, 8
TOKENS = 32 << 20


def child_floor(data: str, dtype: str, warmup: float, run: float) -> dict:
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.sampler import Sampler

    ds = TokenDataset.open(data)
    sampler = Sampler([ds], SEQ, MICRO, seed=0)
    maps = [np.asarray(ds.tokens(s)) for s in range(ds.num_shards)]  # plain views: fastest
    rng = np.random.default_rng(0)
    refs = sampler.locate(rng.permutation(sampler.num_samples[0]))
    pairs = list(zip(refs.shard.tolist(), refs.offset.tolist(), strict=True))
    state = {"i": 0}
    if dtype == "uint16":
        out = np.empty((MICRO, SEQ + 1), dtype=np.uint16)

        def nxt():
            i = state["i"]
            for row in range(MICRO):
                s, o = pairs[(i + row) % len(pairs)]
                out[row] = maps[s][o : o + SEQ + 1]
            state["i"] = i + MICRO
    else:  # what a loader must do at least: int64 inputs and labels, fresh per batch

        def nxt():
            i = state["i"]
            inp = np.empty((MICRO, SEQ), dtype=np.int64)
            lab = np.empty((MICRO, SEQ), dtype=np.int64)
            for row in range(MICRO):
                s, o = pairs[(i + row) % len(pairs)]
                w = maps[s][o : o + SEQ + 1]
                inp[row] = w[:-1]
                lab[row] = w[1:]
            state["i"] = i + MICRO
            return inp, lab

    return measure(nxt, MICRO * SEQ, warmup, run)


def child_ours(data: str, workers: int, warmup: float, run: float, prefetch: int) -> dict:
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.loader import TokenLoader

    ds = TokenDataset.open(data)
    loader = TokenLoader(
        ds, SEQ, MICRO * 64, MICRO, seed=0, shuffle="global", num_workers=workers, prefetch=prefetch
    )
    out = measure(lambda: next(loader), MICRO * SEQ, warmup, run)
    loader.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--dtype", default="uint16")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--run", type=float, default=3.0)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="rounds; each row keeps its best")
    p.add_argument("--quick", action="store_true", help="our loader and the floor only")
    p.add_argument(
        "--only-ours",
        action="store_true",
        help="the floors and our in-process and thread rows only (no peers, no workers)",
    )
    p.add_argument(
        "--resummarise", action="store_true", help="recompute the summary of the last run"
    )
    a = p.parse_args()
    if a.resummarise:
        import json

        path = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "results", "loader_throughput.json"
        )
        with open(path) as f:
            obj = json.load(f)
        obj["rows"] = best_rows(obj["runs"])
        obj["summary"] = summarise(obj["rows"])
        write_result("loader_throughput", obj)
        print_table(obj["rows"], obj["summary"])
        return
    if a.child == "floor":
        print(__import__("json").dumps(child_floor(a.data, a.dtype, a.warmup, a.run)))
        return
    if a.child == "ours":
        print(__import__("json").dumps(child_ours(a.data, a.workers, a.warmup, a.run, a.prefetch)))
        return

    t_start = time.time()
    data = make_dataset("tp32m", TOKENS)
    me = [
        sys.executable,
        os.path.abspath(__file__),
        "--data",
        data,
        "--warmup",
        str(a.warmup),
        "--run",
        str(a.run),
    ]
    configs: dict[str, tuple[list[str], dict | None]] = {}
    for dtype in ("uint16", "int64"):
        configs[f"floor numpy memmap gather ({dtype})"] = (
            [*me, "--child", "floor", "--dtype", dtype],
            None,
        )
    configs["steadytrain TokenLoader in-process (prefetch=0)"] = (
        [*me, "--child", "ours", "--workers", "0", "--prefetch", "0"],
        None,
    )
    for w in (0,) if a.only_ours else (0, 1, 2):
        configs[f"steadytrain TokenLoader workers={w}"] = (
            [*me, "--child", "ours", "--workers", str(w)],
            None,
        )
    notes = []
    partial = a.quick or a.only_ours
    if not partial:
        py, note = ensure_peer_env()
        notes.append(note)
        peer_script = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "peers", "loader_peers.py"
        )
        env = {"PYTHONPATH": STUB_DIR}
        for peer in ("torchdata", "litdata", "streaming"):
            for w in (0, 1, 2):
                configs[f"{peer} workers={w}"] = (
                    (
                        [
                            PEER_PY,
                            peer_script,
                            peer,
                            "--data",
                            data,
                            "--work",
                            os.path.join(WORK, "peers"),
                            "--workers",
                            str(w),
                            "--warmup",
                            str(a.warmup),
                            "--run",
                            str(a.run),
                        ],
                        env,
                    )
                    if py is not None
                    else ([], {"error": note})
                )
    rows: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(a.repeats):  # rounds interleave configurations: a busy machine hits all alike
        for name, (cmd, env) in configs.items():
            r = run_json(cmd, 240, env=env) if cmd else dict(env or {})
            runs[name].append(r)
    rows = best_rows(runs)
    summary = summarise(rows)
    path = write_result(
        "loader_throughput_quick" if partial else "loader_throughput",
        {
            "seq_len": SEQ,
            "micro_batch": MICRO,
            "dataset_tokens": TOKENS,
            "rows": rows,
            "runs": runs,
            "summary": summary,
            "notes": notes,
            "wall_s": time.time() - t_start,
        },
    )
    print_table(rows, summary)
    print(f"wrote {path}")


def print_table(rows: dict[str, dict], summary: dict) -> None:
    print(f"{'configuration':48s} {'M tok/s':>9s} {'M tok/CPU-s':>12s} {'CPU ns/tok':>11s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:48s} error: {r['error'][:80]}")
        else:
            print(
                f"{name:48s} {r['best_m_tokens_per_s']:9.1f} {r['m_tokens_per_cpu_s']:12.1f} "
                f"{r['cpu_ns_per_token']:11.2f}"
            )
    for k, v in summary.items():
        print(f"{k}: {v}")


def best_rows(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each configuration's best round (lowest CPU ns/token). CPU time counts live worker
    processes; a peer that ends workers mid-run can show a non-positive CPU delta, which is
    reported as not measurable rather than as a number."""
    rows: dict[str, dict] = {}
    for name, rs in runs.items():
        good = [dict(r) for r in rs if "error" not in r]
        for r in good:
            if not r["cpu_ns_per_token"] > 0:
                r["cpu_ns_per_token"] = r["m_tokens_per_cpu_s"] = float("nan")
        timed = [r for r in good if r["cpu_ns_per_token"] > 0]
        if timed:
            rows[name] = min(timed, key=lambda r: r["cpu_ns_per_token"])
        elif good:
            rows[name] = good[-1]
        else:
            rows[name] = rs[-1]
        if good:
            rows[name]["runs"] = len(good)
            rows[name]["best_m_tokens_per_s"] = max(r["m_tokens_per_s"] for r in good)
    return rows


def summarise(rows: dict[str, dict]) -> dict:
    ok = {k: v for k, v in rows.items() if "error" not in v and v["cpu_ns_per_token"] > 0}
    peers = {k: v for k, v in ok.items() if not k.startswith(("floor", "steadytrain"))}
    out: dict = {}
    ours0 = ok.get("steadytrain TokenLoader workers=0")
    for fname in ("uint16", "int64"):
        floor = ok.get(f"floor numpy memmap gather ({fname})")
        for oname, key in (
            ("inproc", "steadytrain TokenLoader in-process (prefetch=0)"),
            ("w0", "steadytrain TokenLoader workers=0"),
        ):
            mine = ok.get(key)
            if floor and mine:
                out[f"ours_{oname}_vs_{fname}_floor_per_cpu"] = (
                    mine["m_tokens_per_cpu_s"] / floor["m_tokens_per_cpu_s"]
                )
    if peers and ours0:
        best = max(peers, key=lambda k: peers[k]["m_tokens_per_cpu_s"])
        out["fastest_peer_per_cpu"] = best
        inproc = ok.get("steadytrain TokenLoader in-process (prefetch=0)")
        if inproc:
            out["ours_inproc_vs_fastest_peer_per_cpu"] = (
                inproc["m_tokens_per_cpu_s"] / peers[best]["m_tokens_per_cpu_s"]
            )
        out["ours_w0_vs_fastest_peer_per_cpu"] = (
            ours0["m_tokens_per_cpu_s"] / peers[best]["m_tokens_per_cpu_s"]
        )
        for w in (1, 2):
            mine = ok.get(f"steadytrain TokenLoader workers={w}")
            theirs = {k: v for k, v in peers.items() if k.endswith(f"workers={w}")}
            if mine and theirs:
                b = max(theirs, key=lambda k: theirs[k]["m_tokens_per_cpu_s"])
                out[f"ours_w{w}_vs_fastest_peer_w{w}_per_cpu"] = (
                    mine["m_tokens_per_cpu_s"] / theirs[b]["m_tokens_per_cpu_s"]
                )
                walls = [
                    v["best_m_tokens_per_s"]
                    for k, v in rows.items()
                    if "error" not in v
                    and k.endswith(f"workers={w}")
                    and not k.startswith(("floor", "steadytrain"))
                ]
                out[f"ours_w{w}_vs_fastest_peer_w{w}_wall"] = mine["best_m_tokens_per_s"] / max(
                    walls
                )
    return out


if __name__ == "__main__":
    main()
