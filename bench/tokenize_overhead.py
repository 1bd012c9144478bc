"""Benchmark: ``steadytrain tokenize`` end to end vs raw ``tokenizers``, like for like.

Same corpus (the Python standard library's source), same machine, same tokenizer (an 8k
byte-level BPE trained once on the corpus), same parallelism (W), in one run:

- baseline ``encode_batch_fast``: raw ``tokenizers`` without offsets (what our workers call;
  ``encode_batch`` also computes offsets, so it is no like-for-like baseline and runs only
  with ``--with-encode-batch``), the texts already in memory, one call, rayon with W threads
  (``RAYON_NUM_THREADS=W``), in a fresh process; only the call is timed (``seconds``; the
  time to take the ids out of the encodings is reported as ``ids_s``);
- the floor: texts in memory, W forked processes that pull ~256 KiB chunks of documents
  (our chunk size) from a shared work queue, dynamically, and encode each with
  ``encode_batch_fast``, taking the ids out (our workers' work, minus reading, transfer and
  writing); timed from a common start to the last finish;
- ours: ``steadytrain.data.ingest.tokenize.tokenize(paths, out, workers=W)`` in a fresh process:
  listing and reading files, decoding, W encoder processes, EOS, shard writing, checksums,
  manifest and the final rename; the call is timed (interpreter start-up and imports are
  reported separately as ``process_wall_s``).

Each repetition runs the contenders in a rotating order (repetition r starts at the r-th).
Every figure is reported as min/median/max over the repetitions; overheads are
``median(ours) / median(baseline) - 1``, and per repetition (paired) as a spread. Peak
memory is the peak RSS summed over the tokenize process and all its children (forkserver,
workers), sampled every 20 ms, at two corpus sizes (1x and 4x the corpus) to show it does
not grow with the corpus.

    .venv/bin/python bench/tokenize_overhead.py [--workers 2] [--reps 5]

Writes bench/results/tokenize_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "tokenize_overhead.json")

BASELINE = r"""
import json, os, sys, time
from tokenizers import Tokenizer
paths, tok_path, method = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
texts = []
for p in paths:
    with open(p, "rb") as f:
        texts.append(f.read().decode("utf-8", errors="replace"))
texts = [t for t in texts if t]  # tokenize skips empty documents too
tok = Tokenizer.from_file(tok_path)
fn = getattr(tok, method)
import resource
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
encs = fn(texts, add_special_tokens=False)
dt, dc = time.perf_counter() - t0, cpu() - c0
t1 = time.perf_counter()
ids = [e.ids for e in encs]
ids_s = time.perf_counter() - t1
tokens = sum(len(i) for i in ids) + len(ids)  # + one EOS per document, like ours
print(json.dumps({"seconds": dt, "tokens": tokens, "cpu_s": dc, "ids_s": ids_s}))
"""

# The floor for W processes: texts already in memory (read before the fork), cut into the
# same ~256 KiB chunks our pipeline sends its workers; W forked processes take the next
# chunk from a shared counter (a work queue: whoever is free takes the next one, so neither
# process idles while the other has a long tail), encode it with encode_batch_fast and take
# the ids out. Timed from a common start to the last finish.
FLOOR = r"""
import json, os, sys, time, multiprocessing as mp
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
paths, tok_path, W, CHUNK = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
texts = []
for p in paths:
    with open(p, "rb") as f:
        texts.append(f.read().decode("utf-8", errors="replace"))
texts = [t for t in texts if t]
chunks, cur, size = [], [], 0
for t in texts:
    cur.append(t); size += len(t)
    if size >= CHUNK:
        chunks.append(cur); cur, size = [], 0
if cur:
    chunks.append(cur)
def work(start, nxt, q):
    tok = Tokenizer.from_file(tok_path)
    n, done = 0, 0
    start.wait()
    c0 = time.process_time()
    while True:
        with nxt.get_lock():
            i = nxt.value
            nxt.value = i + 1
        if i >= len(chunks):
            break
        n += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(chunks[i], add_special_tokens=False))
        done += 1
    q.put((n, time.perf_counter(), time.process_time() - c0, done))
ctx = mp.get_context("fork")
start, q, nxt = ctx.Event(), ctx.Queue(), ctx.Value("q", 0)
procs = [ctx.Process(target=work, args=(start, nxt, q)) for r in range(W)]
for p in procs: p.start()
time.sleep(1.0)  # every process has built its tokenizer
t0 = time.perf_counter(); start.set()
res = [q.get() for _ in procs]
for p in procs: p.join()
print(json.dumps({"seconds": max(r[1] for r in res) - t0, "tokens": sum(r[0] for r in res),
                  "cpu_s": sum(r[2] for r in res), "chunks_per_process": [r[3] for r in res],
                  "finish_spread_s": max(r[1] for r in res) - min(r[1] for r in res)}))
"""

OURS = r"""
import json, sys, time
from steadytrain.data.ingest.tokenize import tokenize
paths, tok_path, out, workers = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
res = tokenize(paths, out, tokenizer=tok_path, workers=workers)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "tokens": res.manifest.num_tokens, "shards": len(res.manifest.shards)}))
"""


def _run(code: str, args: list[str], env: dict[str, str]) -> dict:
    """Run a fresh Python process; return its JSON line plus wall time and peak tree RSS."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, env={**os.environ, **env}
    )
    peak = main_peak = 0
    cpu_by_pid: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, main_peak
        p = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                procs = [p, *p.children(recursive=True)]
                rss = 0
                for q in procs:
                    try:
                        rss += q.memory_info().rss
                        t = q.cpu_times()
                        cpu_by_pid[q.pid] = t.user + t.system
                    except psutil.Error:
                        pass
                peak = max(peak, rss)
                main_peak = max(main_peak, p.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = proc.communicate()
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed with {proc.returncode}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    result["peak_rss_mb"] = peak / 2**20
    result["main_peak_rss_mb"] = main_peak / 2**20
    # CPU of the whole process tree, start-up included (sampled: the last 20 ms of a process
    # that exits may be missed). Baselines report the CPU of their timed call instead.
    result["tree_cpu_s"] = sum(cpu_by_pid.values())
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


def _cpu(r: dict) -> float:
    # Baselines report the CPU of their timed call; ours its whole process tree (imports
    # and pool start-up included), which overstates our overhead.
    return r.get("cpu_s", r["tree_cpu_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--limit-mb", type=float, default=None, help="use only part of the corpus")
    ap.add_argument(
        "--with-encode-batch",
        action="store_true",
        help="also run encode_batch (computes offsets too: not like for like) for reference",
    )
    ap.add_argument("--skip-memory", action="store_true", help="skip the 4x-corpus memory run")
    ap.add_argument("--out", default=RESULTS, help="where the JSON goes")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    from steadytrain.data.ingest.corpus import stdlib_corpus_paths
    from steadytrain.data.ingest.sources import iter_documents, list_sources
    from steadytrain.data.ingest.tokenize import CHUNK_CHARS
    from steadytrain.data.ingest.tokenizer import train_bpe

    load_start = os.getloadavg()
    limit = int(args.limit_mb * 2**20) if args.limit_mb else None
    paths = stdlib_corpus_paths(limit)
    corpus_bytes = sum(os.path.getsize(p) for p in paths)
    W = args.workers
    work = tempfile.mkdtemp(prefix="tokenize-bench-")
    tok_path = os.path.join(work, "tokenizer.json")
    t0 = time.perf_counter()
    spec = train_bpe(iter_documents(list_sources(paths)), args.vocab)
    with open(tok_path, "w") as f:
        f.write(spec.json_text)
    train_s = time.perf_counter() - t0
    list1 = os.path.join(work, "paths1.json")
    json.dump(paths, open(list1, "w"))
    print(f"corpus: {len(paths)} files, {corpus_bytes / 2**20:.1f} MiB; workers={W}; "
          f"BPE {args.vocab} trained in {train_s:.1f} s", file=sys.stderr)  # fmt: skip

    base_env = {"RAYON_NUM_THREADS": str(W), "TOKENIZERS_PARALLELISM": "true"}
    contenders = ["encode_batch_fast", "floor_dynamic", "ours"]
    if args.with_encode_batch:
        contenders.insert(0, "encode_batch")
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    orders = []
    for rep in range(args.reps):
        k = rep % len(contenders)
        order = contenders[k:] + contenders[:k]  # rotating: each takes every position
        orders.append(order)
        for name in order:
            if name == "floor_dynamic":
                r = _run(FLOOR, [list1, tok_path, str(W), str(CHUNK_CHARS)], {})
            elif name == "ours":
                out = os.path.join(work, f"ds-{rep}")
                r = _run(OURS, [list1, tok_path, out, str(W)], {})
                subprocess.run(["rm", "-rf", out], check=True)
            else:
                r = _run(BASELINE, [list1, tok_path, name], base_env)
            runs[name].append(r)
        print(f"rep {rep}: " + ", ".join(
            f"{k} {v[-1]['seconds']:.2f} s / {_cpu(v[-1]):.1f} cpu-s"
            for k, v in runs.items()), file=sys.stderr)  # fmt: skip
    tokens = {r["tokens"] for v in runs.values() for r in v}
    if len(tokens) != 1:
        raise SystemExit(f"contenders disagree on the token count: {sorted(tokens)}")
    big = tiny = None
    if not args.skip_memory:  # memory at two corpus sizes: the same files once and 4x over
        list4 = os.path.join(work, "paths4.json")
        json.dump(paths * 4, open(list4, "w"))
        big = _run(OURS, [list4, tok_path, os.path.join(work, "ds-4x"), str(W)], {})
    # Fixed cost (interpreter, imports, worker start-up) on a one-file input, for context.
    tiny_list = os.path.join(work, "tiny.json")
    json.dump([p for p in paths if os.path.getsize(p) > 0][:1], open(tiny_list, "w"))
    tiny = _run(OURS, [tiny_list, tok_path, os.path.join(work, "ds-tiny"), str(W)], {})
    subprocess.run(["rm", "-rf", work], check=True)

    def row(rs: list[dict]) -> dict:
        secs = [r["seconds"] for r in rs]
        return {
            "seconds": _spread(secs),
            "cpu_s": _spread([_cpu(r) for r in rs]),
            "m_tokens_per_s": _spread(
                [r["tokens"] / s / 1e6 for r, s in zip(rs, secs, strict=True)]
            ),
            "mib_per_s": _spread([corpus_bytes / 2**20 / s for s in secs]),
            "peak_rss_mb": _spread([r["peak_rss_mb"] for r in rs]),
            "process_wall_s": _spread([r["process_wall_s"] for r in rs]),
            "all_seconds": [round(s, 3) for s in secs],
            "all_cpu_s": [round(_cpu(r), 3) for r in rs],
        }

    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    med_cpu = {k: statistics.median(_cpu(r) for r in v) for k, v in runs.items()}
    overhead: dict[str, dict] = {}
    for base in [c for c in contenders if c != "ours"]:
        paired = [
            o["seconds"] / b["seconds"] - 1 for o, b in zip(runs["ours"], runs[base], strict=True)
        ]
        overhead[base] = {
            "wall_from_medians": round(med["ours"] / med[base] - 1, 4),
            "cpu_from_medians": round(med_cpu["ours"] / med_cpu[base] - 1, 4),
            "wall_paired_per_rep": _spread(paired),
            "reps_where_ours_was_faster": sum(p < 0 for p in paired),
        }
    result = {
        "benchmark": "tokenize_overhead",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg(),
        "corpus": {"files": len(paths), "bytes": corpus_bytes, "source": "python stdlib *.py"},
        "workers": W,
        "tokenizer": f"byte-level BPE, vocab {args.vocab}",
        "tokens": tokens.pop(),
        "reps": args.reps,
        "orders": orders,
        "floor_chunk_chars": CHUNK_CHARS,
        "floor_chunks_per_process": [r["chunks_per_process"] for r in runs["floor_dynamic"]],
        "floor_finish_spread_s": [round(r["finish_spread_s"], 3) for r in runs["floor_dynamic"]],
        "baseline_ids_s": [round(r["ids_s"], 3) for r in runs["encode_batch_fast"]],
        "rows": {k: row(v) for k, v in runs.items()},
        "overhead": overhead,
        "fixed_cost_one_file": {
            "seconds": round(tiny["seconds"], 3),
            "tree_cpu_s": round(tiny["tree_cpu_s"], 3),
            "process_wall_s": round(tiny["process_wall_s"], 3),
        },
        "target": "overhead < 15% vs raw encode_batch_fast (from medians); peak RSS flat",
    }
    ours_peaks = [r["peak_rss_mb"] for r in runs["ours"]]
    result["memory"] = {
        "corpus_1x": {
            "bytes": corpus_bytes,
            "peak_rss_mb": _spread(ours_peaks),
            "main_peak_rss_mb": _spread([r["main_peak_rss_mb"] for r in runs["ours"]]),
        },
        "baseline_encode_batch_fast_peak_rss_mb": _spread(
            [r["peak_rss_mb"] for r in runs["encode_batch_fast"]]
        ),
    }
    if big is not None:
        result["memory"]["corpus_4x"] = {
            "bytes": 4 * corpus_bytes,
            "peak_rss_mb": round(big["peak_rss_mb"], 1),
            "main_peak_rss_mb": round(big["main_peak_rss_mb"], 1),
            "tokens": big["tokens"],
            "seconds": round(big["seconds"], 3),
        }
    # Peak RSS "flat": 4x the corpus within 25% of 1x (allocator and tokenizer caches settle).
    flat = big is None or big["peak_rss_mb"] <= 1.25 * max(ours_peaks)
    result["pass"] = overhead["encode_batch_fast"]["wall_from_medians"] < 0.15 and flat
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: result[k] for k in ("overhead", "memory", "pass")}, indent=2))


if __name__ == "__main__":
    main()
