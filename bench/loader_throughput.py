"""Loader throughput: tokens/s and CPU ns/token, global shuffle, seq 2048, micro-batch 8.

Side by side on the same tokens (a 32 Mi-token steadytrain dataset in the page cache), every
contender producing what a trainer needs, contiguous int64 inputs and labels it may keep,
and every one slicing the same plain ``np.asarray`` views of the shard maps (slicing the
``np.memmap`` subclass itself costs more than a window's copy):

- floors (numpy, in-process): the uint16 window gather; the int64 floor, built the way the
  fastest code would (gather the windows into one uint16 buffer, then one whole-batch cast
  each for inputs and labels, into fresh arrays); the same into one reused buffer (the copy's
  physical limit, but a contract no loader can offer: each call overwrites the last); one
  int64 cast with inputs and labels as strided views of it (cheaper, not the same contract);
  and the int64 floor handed out as a dict of three torch tensors, what every loader here
  returns (the floor returns numpy arrays: this row prices the tensors, not a floor);
- steadytrain's TokenLoader as shipped (``workers=0``: a background thread, ``prefetch=4``),
  in-process (``prefetch=0``), and with 1 and 2 worker processes;
- peers, each configured as its own documentation recommends (see bench/peers/): torchdata
  StatefulDataLoader fetching whole micro-batches (``BatchSampler`` + ``batch_size=None``),
  litdata StreamingDataset + TokensLoader + StreamingDataLoader, mosaicml-streaming MDS, each
  with 0/1/2 workers; torchdata's per-sample default at 0 workers as a reference row.

Every configuration runs in its own process; rounds run all configurations in a rotating
order (round r starts at the r-th), so machine load falls on all alike. Each row reports
min/median/max over the rounds; ratios are taken from medians, and ``paired_per_cpu`` gives
the per-round ratios (both contenders from the same round) as min/median/max. "Per CPU-s" is
tokens per CPU-second of all the configuration's processes and threads, the figure that
depends least on how busy the machine is.

    .venv/bin/python bench/loader_throughput.py              -> bench/results/loader_throughput.json
    .venv/bin/python bench/loader_throughput.py --peers torchdata   (torchdata only; it runs in
        this interpreter when it has torchdata, so the peer venv is not needed)
    .venv/bin/python bench/loader_throughput.py --only-ours  -> bench/results/loader_throughput_quick.json

``--only-ours`` runs the floors and the in-process / background-thread rows (no peers, no
worker processes), ``--quick`` adds our worker-process rows; both write
``loader_throughput_quick.json`` so the full side-by-side result is kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
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
FLOOR_INT64 = "floor: gather, whole-batch int64 cast"
FLOOR_UINT16 = "floor: gather uint16 windows"
FLOOR_VIEWS = "reference: one int64 cast, inputs/labels as views"
FLOOR_REUSED = "reference: int64 floor into one reused buffer"
FLOOR_TENSORS = "reference: int64 floor, handed out as torch tensors"
INPROC = "steadytrain TokenLoader in-process (prefetch=0)"
PEERS = {  # row prefix -> loader_peers.py mode
    "torchdata (batched fetch)": "torchdata",
    "litdata": "litdata",
    "mosaic streaming": "streaming",
}
BASELINE = "baseline TokenLoader"  # --baseline-src: the loader of another checkout
REFERENCE_PEER = "torchdata per-sample default"  # not a contender: shows the batched gain


def child_floor(data: str, kind: str, warmup: float, run: float) -> dict:
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.sampler import Sampler

    ds = TokenDataset.open(data)
    sampler = Sampler([ds], SEQ, MICRO, seed=0)
    maps = [np.asarray(ds.tokens(s)) for s in range(ds.num_shards)]  # plain views: fastest
    rng = np.random.default_rng(0)
    refs = sampler.locate(rng.permutation(sampler.num_samples[0]))
    pairs = list(zip(refs.shard.tolist(), refs.offset.tolist(), strict=True))
    buf = np.empty((MICRO, SEQ + 1), dtype=np.uint16)
    state = {"i": 0}

    def gather() -> None:
        i = state["i"]
        for row in range(MICRO):
            s, o = pairs[(i + row) % len(pairs)]
            buf[row] = maps[s][o : o + SEQ + 1]
        state["i"] = i + MICRO

    if kind == "uint16":
        nxt = gather
    elif kind == "int64":  # the contract: fresh contiguous int64 inputs and labels

        def nxt():
            gather()
            both = np.empty((2, MICRO, SEQ), dtype=np.int64)
            both[0] = buf[:, :-1]
            both[1] = buf[:, 1:]
            return both
    elif kind == "reused":  # the same casts into one buffer, overwritten every call

        def nxt():
            gather()
            out[0] = buf[:, :-1]
            out[1] = buf[:, 1:]
            return out

        out = np.empty((2, MICRO, SEQ), dtype=np.int64)
    elif kind == "tensors":  # the int64 floor as a batch of the loader's form (not a floor)
        import torch

        wrap, ids = torch.from_numpy, np.arange(MICRO)

        def nxt():
            gather()
            both = np.empty((2, MICRO, SEQ), dtype=np.int64)
            both[0] = buf[:, :-1]
            both[1] = buf[:, 1:]
            return {"input_ids": wrap(both[0]), "labels": wrap(both[1]), "sample_ids": wrap(ids)}
    else:  # "views": one cast; labels and inputs overlap in one array

        def nxt():
            gather()
            w = buf.astype(np.int64)
            return w[:, :-1], w[:, 1:]

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


def build_configs(a: argparse.Namespace, data: str) -> tuple[dict, list[str]]:
    """Row name -> (command, extra environment or an error row)."""
    me = [sys.executable, os.path.abspath(__file__), "--data", data]
    me += ["--warmup", str(a.warmup), "--run", str(a.run)]
    configs: dict[str, tuple[list[str], dict | None]] = {}
    floors = (
        (FLOOR_UINT16, "uint16"),
        (FLOOR_INT64, "int64"),
        (FLOOR_REUSED, "reused"),
        (FLOOR_VIEWS, "views"),
        (FLOOR_TENSORS, "tensors"),
    )
    for name, kind in floors:
        configs[name] = ([*me, "--child", "floor", "--kind", kind], None)
    configs[INPROC] = ([*me, "--child", "ours", "--workers", "0", "--prefetch", "0"], None)
    for w in (0,) if a.only_ours else (0, 1, 2):
        configs[f"steadytrain TokenLoader workers={w}"] = (
            [*me, "--child", "ours", "--workers", str(w)],
            None,
        )
    if a.baseline_src:  # the same rows on another checkout's loader (a before/after pair)
        env = {"PYTHONPATH": os.path.abspath(a.baseline_src)}
        configs[f"{BASELINE} in-process (prefetch=0)"] = (
            [*me, "--child", "ours", "--workers", "0", "--prefetch", "0"],
            env,
        )
        configs[f"{BASELINE} workers=0"] = ([*me, "--child", "ours", "--workers", "0"], env)
    notes: list[str] = []
    if a.quick or a.only_ours:
        return configs, notes
    wanted = set(a.peers.split(",")) if a.peers else set(PEERS.values())
    py, note = peer_python(a.peer_python, wanted)
    notes.append(note)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "loader_peers.py")
    env = {"PYTHONPATH": STUB_DIR}
    peer_rows = [
        (f"{n} workers={w}", m, w) for n, m in PEERS.items() if m in wanted for w in (0, 1, 2)
    ]
    if "torchdata" in wanted:
        peer_rows.append((f"{REFERENCE_PEER} workers=0", "torchdata-per-sample", 0))
    for name, mode, w in peer_rows:
        cmd = [py or PEER_PY, script, mode, "--data", data, "--work", os.path.join(WORK, "peers")]
        cmd += ["--workers", str(w), "--warmup", str(a.warmup), "--run", str(a.run)]
        configs[name] = (cmd, env) if py is not None else ([], {"error": note})
    return configs, notes


def peer_python(choice: str, wanted: set[str]) -> tuple[str | None, str]:
    """The interpreter that runs the peers, and a note saying which. ``auto``: the peer venv
    (installed on first use), except when only torchdata is asked for and this interpreter
    has it (the project's dev environment pins the peer venv's torchdata 0.11.0 and torch
    2.13.0), which saves installing the peer venv. ``self``: this interpreter; ``venv``: the
    peer venv."""
    if choice == "self" or (choice == "auto" and wanted <= {"torchdata"}):
        if importlib.util.find_spec("torchdata") is not None:
            from importlib.metadata import version

            return (
                sys.executable,
                f"peers ran in this interpreter (torchdata {version('torchdata')})",
            )
        if choice == "self":
            return None, f"torchdata is not importable by {sys.executable}"
    return ensure_peer_env()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--kind", default="int64")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--run", type=float, default=2.0)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="rounds, in rotating order")
    p.add_argument("--quick", action="store_true", help="our loader and the floors only")
    p.add_argument(
        "--peers",
        default="",
        help=f"comma-separated peers to run (default all: {','.join(PEERS.values())})",
    )
    p.add_argument(
        "--baseline-src",
        default="",
        help="a src/ directory of another checkout (e.g. `git archive HEAD src | tar -x -C "
        "DIR`, then DIR/src): its loader runs as extra rows, for a before/after in one run",
    )
    p.add_argument(
        "--peer-python",
        default="auto",
        choices=("auto", "self", "venv"),
        help="interpreter for the peers (see peer_python)",
    )
    p.add_argument(
        "--only-ours",
        action="store_true",
        help="the floors and our in-process and thread rows only (no peers, no workers)",
    )
    p.add_argument(
        "--resummarise", action="store_true", help="recompute the summary of the last run"
    )
    a = p.parse_args()
    if a.child == "floor":
        print(json.dumps(child_floor(a.data, a.kind, a.warmup, a.run)))
        return
    if a.child == "ours":
        print(json.dumps(child_ours(a.data, a.workers, a.warmup, a.run, a.prefetch)))
        return
    if a.resummarise:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        with open(os.path.join(path, "loader_throughput.json")) as f:
            obj = json.load(f)
        obj["rows"] = spread_rows(obj["runs"])
        obj["summary"] = summarise(obj["rows"])
        obj["summary"]["paired_per_cpu"] = paired(obj["runs"])
        write_result("loader_throughput", obj)
        print_table(obj["rows"], obj["summary"])
        return

    t_start = time.time()
    load_start = os.getloadavg()
    data = make_dataset("tp32m", TOKENS)
    configs, notes = build_configs(a, data)
    names = list(configs)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    orders = []
    for r in range(a.repeats):
        k = r % len(names)
        order = names[k:] + names[:k]  # rotating: each row takes every position in turn
        orders.append(order)
        for name in order:
            cmd, env = configs[name]
            res = run_json(cmd, 240, env=env) if cmd else dict(env or {})
            if name.startswith(BASELINE) and "error" not in res:
                res["loader_src"] = a.baseline_src
            res["round"] = r
            runs[name].append(res)
        print(f"round {r + 1}/{a.repeats} done, {time.time() - t_start:.0f} s", file=sys.stderr)
    rows = spread_rows(runs)
    summary = summarise(rows)
    summary["paired_per_cpu"] = paired(runs)
    partial = a.quick or a.only_ours
    path = write_result(
        "loader_throughput_quick" if partial else "loader_throughput",
        {
            "seq_len": SEQ,
            "micro_batch": MICRO,
            "dataset_tokens": TOKENS,
            "warmup_s": a.warmup,
            "run_s": a.run,
            "repeats": a.repeats,
            "load_average_at_start": load_start,
            "load_average_at_end": os.getloadavg(),
            "cpus": os.cpu_count(),
            "rows": rows,
            "runs": runs,
            "orders": orders,
            "summary": summary,
            "notes": notes,
            "wall_s": time.time() - t_start,
        },
    )
    print_table(rows, summary)
    print(f"wrote {path}")


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def spread_rows(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Min/median/max over the rounds of each configuration. CPU time counts live worker
    processes; a peer that ends workers mid-run can show a non-positive CPU delta, which is
    left out of the CPU figures (and counted in ``cpu_unmeasured``) rather than reported."""
    rows: dict[str, dict] = {}
    for name, rs in runs.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            rows[name] = {"error": rs[-1].get("error", "no run")}
            continue
        row: dict = {"runs": len(good), "errors": len(rs) - len(good)}
        row["m_tokens_per_s"] = _spread([r["m_tokens_per_s"] for r in good])
        timed = [r for r in good if r["cpu_ns_per_token"] > 0]
        row["cpu_unmeasured"] = len(good) - len(timed)
        if timed:
            row["m_tokens_per_cpu_s"] = _spread([r["m_tokens_per_cpu_s"] for r in timed])
            row["cpu_ns_per_token"] = _spread([r["cpu_ns_per_token"] for r in timed])
        rows[name] = row
    return rows


THREAD = "steadytrain TokenLoader workers=0"
TORCHDATA_W0 = "torchdata (batched fetch) workers=0"


def paired(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per-round ratios of tokens per CPU-second (both contenders from the same round, so
    the load they met was alike), as min/median/max over the rounds both completed."""
    out: dict[str, dict[str, float]] = {}
    pairs = [
        (f"ours_{tag}_vs_{btag}", mine, base)
        for tag, mine in (
            ("thread", THREAD),
            ("inproc", INPROC),
            ("baseline_thread", f"{BASELINE} workers=0"),
            ("baseline_inproc", f"{BASELINE} in-process (prefetch=0)"),
        )
        for btag, base in (
            ("int64_floor", FLOOR_INT64),
            ("reused_floor", FLOOR_REUSED),
            ("tensor_floor", FLOOR_TENSORS),
            ("torchdata_w0", TORCHDATA_W0),
        )
    ]
    pairs += [
        ("ours_thread_vs_baseline_thread", THREAD, f"{BASELINE} workers=0"),
        ("ours_inproc_vs_baseline_inproc", INPROC, f"{BASELINE} in-process (prefetch=0)"),
    ]
    for key, mine, base in pairs:
        by_round = {r["round"]: r for r in runs.get(base, []) if r.get("m_tokens_per_cpu_s")}
        ratios = [
            r["m_tokens_per_cpu_s"] / by_round[r["round"]]["m_tokens_per_cpu_s"]
            for r in runs.get(mine, [])
            if r.get("m_tokens_per_cpu_s") and r.get("round") in by_round
        ]
        if ratios:
            out[key] = _spread(ratios)
    return out


def _med(row: dict | None, key: str) -> float | None:
    if row is None or key not in row:
        return None
    return row[key]["median"]


def summarise(rows: dict[str, dict]) -> dict:
    """Ratios of medians: ours against the int64 floor and against the fastest peer (by
    median tokens per CPU-second, overall and at the same worker count; by wall clock too)."""
    ok = {k: v for k, v in rows.items() if "error" not in v}
    peers = {k: v for k, v in ok.items() if k.startswith(tuple(PEERS))}
    out: dict = {}

    def best(cands: dict[str, dict], key: str) -> str | None:
        have = {k: v for k, v in cands.items() if key in v}
        return max(have, key=lambda k: have[k][key]["median"]) if have else None

    ours = {"inproc": INPROC}
    ours.update({f"w{w}": f"steadytrain TokenLoader workers={w}" for w in (0, 1, 2)})
    floor = ok.get(FLOOR_INT64)
    for tag, key in ours.items():
        mine = ok.get(key)
        f_cpu, m_cpu = _med(floor, "m_tokens_per_cpu_s"), _med(mine, "m_tokens_per_cpu_s")
        if f_cpu and m_cpu:
            out[f"ours_{tag}_vs_int64_floor_per_cpu"] = m_cpu / f_cpu
    ref = ok.get(f"{REFERENCE_PEER} workers=0")
    batched = ok.get("torchdata (batched fetch) workers=0")
    if _med(ref, "m_tokens_per_cpu_s") and _med(batched, "m_tokens_per_cpu_s"):
        out["torchdata_batched_vs_per_sample_per_cpu"] = _med(batched, "m_tokens_per_cpu_s") / _med(
            ref, "m_tokens_per_cpu_s"
        )
    top = best(peers, "m_tokens_per_cpu_s")
    if top is None:
        return out
    out["fastest_peer_per_cpu"] = top
    top_cpu = _med(peers[top], "m_tokens_per_cpu_s")
    for tag, key in ours.items():
        m_cpu = _med(ok.get(key), "m_tokens_per_cpu_s")
        if m_cpu:
            out[f"ours_{tag}_vs_fastest_peer_per_cpu"] = m_cpu / top_cpu
    for w in (0, 1, 2):
        mine = ok.get(f"steadytrain TokenLoader workers={w}")
        same = {k: v for k, v in peers.items() if k.endswith(f"workers={w}")}
        if not mine or not same:
            continue
        for key, label in (("m_tokens_per_cpu_s", "per_cpu"), ("m_tokens_per_s", "wall")):
            b = best(same, key)
            if b is not None and _med(mine, key):
                out[f"fastest_peer_w{w}_{label}"] = b
                out[f"ours_w{w}_vs_fastest_peer_w{w}_{label}"] = _med(mine, key) / _med(
                    same[b], key
                )
    return out


def print_table(rows: dict[str, dict], summary: dict) -> None:
    def fmt(row: dict, key: str, spec: str) -> str:
        if key not in row:
            return "n/a"
        s = row[key]
        return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"

    print(f"{'configuration':52s} {'M tok/s':>22s} {'M tok/CPU-s':>22s} {'CPU ns/tok':>20s}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:52s} error: {r['error'][:80]}")
            continue
        print(
            f"{name:52s} {fmt(r, 'm_tokens_per_s', '.1f'):>22s} "
            f"{fmt(r, 'm_tokens_per_cpu_s', '.1f'):>22s} {fmt(r, 'cpu_ns_per_token', '.2f'):>20s}"
        )
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
