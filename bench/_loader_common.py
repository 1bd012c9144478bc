"""Shared by the loader benchmarks: the peer environment, bench datasets, measurements.

Peers (torchdata, litdata, mosaicml-streaming, megatron-core) install into their own venv,
``bench/.env/peers`` (they downgrade numpy, so never into the project's environment). Each
configuration runs in its own subprocess and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.join(ROOT, ".work")
RESULTS = os.path.join(ROOT, "results")
PEER_ENV = os.path.join(ROOT, ".env", "peers")
PEER_PY = os.path.join(PEER_ENV, "bin", "python")
PEER_PINS = [
    "torch==2.13.0",
    "torchdata==0.11.0",
    "litdata==0.2.76",
    "mosaicml-streaming==0.13.0",
    "megatron-core==0.16.1",
    "psutil",
]
# `import streaming` needs torchvision only for its vision datasets; the CPU torchvision
# wheel beside torch 2.13.0 fails to load (`operator torchvision::nms does not exist`).
STUB_DIR = os.path.join(ROOT, ".env", "stubs")
_STUB = '''"""Stub: mosaicml-streaming's text path imports torchvision only for vision datasets."""
class VisionDataset:  # noqa: D101
    def __init__(self, *a, **k):
        raise RuntimeError("torchvision stub")
'''


def ensure_peer_env(timeout_s: float = 900) -> tuple[str | None, str]:
    """(python of the peer venv or None, a note on what happened)."""
    if not os.path.exists(PEER_PY):
        t0 = time.time()
        try:
            subprocess.run([sys.executable, "-m", "venv", PEER_ENV], check=True)
            subprocess.run(
                [PEER_PY, "-m", "pip", "install", "-q", *PEER_PINS], check=True, timeout=timeout_s
            )
        except (subprocess.SubprocessError, OSError) as exc:
            return None, f"peer environment could not be installed: {exc}"
        note = f"installed peers in {time.time() - t0:.0f} s"
    else:
        note = "peer environment present"
    os.makedirs(os.path.join(STUB_DIR, "torchvision", "datasets"), exist_ok=True)
    os.makedirs(os.path.join(STUB_DIR, "torchvision", "transforms"), exist_ok=True)
    files = {
        "torchvision/__init__.py": "",
        "torchvision/datasets/__init__.py": _STUB + "CIFAR10 = VisionDataset\n",
        "torchvision/transforms/__init__.py": "",
        "torchvision/transforms/functional.py": "def to_tensor(x):\n    raise RuntimeError('stub')\n",
    }
    for name, text in files.items():
        with open(os.path.join(STUB_DIR, name), "w") as f:
            f.write(text)
    return PEER_PY, note


def make_dataset(name: str, tokens: int, *, shard_tokens: int = 1 << 24, seed: int = 0) -> str:
    """A real steadytrain dataset of random GPT-2-sized ids (uint16) under bench/.work/."""
    from steadytrain.data.ingest.writer import DatasetWriter

    root = os.path.join(WORK, name)
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    rng = np.random.default_rng(seed)
    with DatasetWriter(
        root, vocab_size=50257, eos_id=50256, tokenizer={"type": "bench"}, shard_tokens=shard_tokens
    ) as w:
        done = 0
        while done < tokens:
            n = min(1 << 22, tokens - done)
            toks = rng.integers(0, 50256, size=n, dtype=np.uint16)
            lengths = rng.integers(200, 4000, size=n // 200 + 2)
            lengths = lengths[np.cumsum(lengths) < n]
            lengths = np.append(lengths, n - lengths.sum())
            toks[np.cumsum(lengths) - 1] = 50256
            w.add_documents(toks, lengths)
            done += n
    return root


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a configuration in its own process; its last stdout line is a JSON object."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def cpu_seconds() -> float:
    """CPU time of this process and its live children (worker processes)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def measure(next_batch, tokens_per_batch: int, warmup_s: float, run_s: float) -> dict[str, float]:
    """Steady-state tokens/s (wall) and CPU ns per token of a batch source."""
    t_end = time.perf_counter() + warmup_s
    first = time.perf_counter()
    next_batch()
    first_batch_s = time.perf_counter() - first
    while time.perf_counter() < t_end:
        next_batch()
    c0, t0, n = cpu_seconds(), time.perf_counter(), 0
    while time.perf_counter() - t0 < run_s:
        next_batch()
        n += 1
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    tokens = n * tokens_per_batch
    return {
        "m_tokens_per_s": tokens / wall / 1e6,
        "cpu_ns_per_token": cpu / tokens * 1e9,
        "m_tokens_per_cpu_s": tokens / cpu / 1e6 if cpu > 0 else float("nan"),
        "batches": n,
        "first_batch_s": first_batch_s,
    }


def write_result(name: str, obj: dict[str, Any]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def make_sparse_11t(
    name: str = "sparse11t", shards: int = 11_000, shard_tokens: int = 10**9
) -> str:
    """An 11T-token dataset that occupies no disk: sparse shard files (reads return zeros).

    The manifest is real (fingerprint computed from it); checksums are placeholders, which
    only ``steadytrain verify`` would reject. For benchmarks of memory and resume at the scale
    of the incident run without 22 TB of data.
    """
    from steadytrain.data.read.format import (
        Manifest,
        ShardInfo,
        compute_fingerprint,
        write_manifest,
    )
    from steadytrain.storage.store import Store

    root = os.path.join(WORK, name)
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    os.makedirs(os.path.join(root, "shards"), exist_ok=True)
    infos = []
    end = np.array([shard_tokens], dtype="<u8").tobytes()
    for i in range(shards):
        tok, idx = f"shards/shard-{i:05d}.tokens", f"shards/shard-{i:05d}.idx"
        with open(os.path.join(root, tok), "wb") as f:
            f.truncate(shard_tokens * 2)
        with open(os.path.join(root, idx), "wb") as f:
            f.write(end)
        infos.append(
            ShardInfo(
                tok, shard_tokens * 2, shard_tokens, 1, "xxh3_64:sparse", idx, 8, "xxh3_64:sparse"
            )
        )
    fp = compute_fingerprint("uint16", 50257, 50256, infos)
    write_manifest(
        Store(root), Manifest("uint16", 50257, 50256, {"type": "sparse"}, tuple(infos), fp)
    )
    return root
