"""Resume cost: time to first batch after restoring at step 3,000,000 vs step 0.

steadytrain: the 11T-token sparse dataset (11,000 shards), global batch 576, seq 4096, rank 0
of 8, micro-batch 8, global shuffle. Two measurements, both reported as min/median/max:

- **fresh process** (what a restart pays): import and dataset open excluded, loader
  construction + ``load_state_dict`` + first batch included; ``--reps`` processes per step,
  the two steps alternating in rotating order;
- **in process**: one process builds, restores and reads ``--reps`` x 4 times, the steps
  alternating; the cold-start noise of a new process (page faults, lazy imports) is out.

Resume cost is constant in the step: the claim is that the two distributions overlap and the
difference of medians is far below either, not a ratio (a ratio of two ~10 ms timings on a
shared machine swings between 0.6 and 1.1).

Peer: torchdata StatefulDataLoader (the peer that can resume) over a Megatron-style map
dataset, restored at 0 and at 3/4 of an epoch of 4 Mi and 16 Mi samples, ``--peer-reps``
processes each; its RandomSampler rebuilds the epoch's permutation and replays the samples
already yielded, so the cost grows with the epoch and the position in it (extrapolated to the
incident run's 2.7e9-sample epoch, 1.7e9 samples in at step 3,000,000).

    .venv/bin/python bench/loader_resume.py [--reps 9] [--peer-reps 3]
        -> bench/results/loader_resume.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _loader_common import (  # noqa: E402
    PEER_PY,
    STUB_DIR,
    ensure_peer_env,
    make_dataset,
    make_sparse_11t,
    run_json,
    write_result,
)

SEQ, G, WORLD, MICRO = 4096, 576, 8, 8
INCIDENT_EPOCH = 11 * 10**12 // SEQ
INCIDENT_YIELDED = 3_000_000 * G % INCIDENT_EPOCH


def _resume_once(ds, step: int) -> tuple[float, int]:  # noqa: ANN001
    from steadytrain.data.read.loader import TokenLoader

    probe = TokenLoader(ds, SEQ, G, MICRO, rank=0, world_size=WORLD, seed=0)
    state = probe.state_dict()
    probe.close()
    state.update(step=step, position=step * G)
    t0 = time.perf_counter()
    loader = TokenLoader(ds, SEQ, G, MICRO, rank=0, world_size=WORLD, seed=0)
    loader.load_state_dict(state)
    batch = next(loader)
    elapsed = time.perf_counter() - t0
    loader.close()
    return elapsed, int(batch["sample_ids"][0])


def child(data: str, step: int) -> dict:
    from steadytrain.data.read.dataset import TokenDataset

    elapsed, first = _resume_once(TokenDataset.open(data), step)
    return {"step": step, "time_to_first_batch_s": elapsed, "first_sample": first}


def in_process(data: str, steps: list[int], reps: int) -> dict[int, list[float]]:
    """``reps`` resumes per step in this process, steps alternating (rotating order)."""
    from steadytrain.data.read.dataset import TokenDataset

    ds = TokenDataset.open(data)
    _resume_once(ds, steps[0])  # warm-up: lazy imports, first page faults
    out: dict[int, list[float]] = {s: [] for s in steps}
    for i in range(reps):
        for step in steps[i % 2 :] + steps[: i % 2]:
            out[step].append(_resume_once(ds, step)[0])
    return out


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def ms(d: dict[str, float]) -> str:
    return f"{d['min'] * 1e3:.1f} / {d['median'] * 1e3:.1f} / {d['max'] * 1e3:.1f} ms"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
        return
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="fresh processes per step")
    ap.add_argument("--peer-reps", type=int, default=3, help="peer processes per point")
    args = ap.parse_args()
    t_start = time.time()
    load = os.getloadavg()
    data = make_sparse_11t()
    steps = [0, 3_000_000]
    runs: dict[int, list[float]] = {s: [] for s in steps}
    for i in range(args.reps):
        for step in steps[i % 2 :] + steps[: i % 2]:
            r = run_json([sys.executable, __file__, "--child", data, str(step)], 120)
            runs[step].append(r["time_to_first_batch_s"])
    inproc = in_process(data, steps, 4 * args.reps)
    ours = {str(k): statistics.median(v) for k, v in runs.items()}
    ours_spread = {str(k): spread(v) for k, v in runs.items()}
    inproc_spread = {str(k): spread(v) for k, v in inproc.items()}
    ratio = ours["3000000"] / ours["0"]
    # paired by repetition: each rotation's 3M time over the same rotation's step-0 time
    paired = [b / a for a, b in zip(runs[0], runs[3_000_000], strict=True)]
    py, note = ensure_peer_env()
    peer = []
    small = make_dataset("tp32m", 32 << 20)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "loader_peers.py")
    for epoch in (1 << 22, 1 << 24):
        for yielded in (0, epoch * 3 // 4):
            if py is None:
                peer.append({"epoch_len": epoch, "yielded": yielded, "error": note})
                continue
            reps = [
                run_json(
                    [
                        PEER_PY,
                        script,
                        "torchdata-resume",
                        "--data",
                        small,
                        "--seq",
                        str(SEQ),
                        "--batch",
                        str(MICRO),
                        "--virtual-len",
                        str(epoch),
                        "--yielded",
                        str(yielded),
                    ],
                    300,
                    env={"PYTHONPATH": STUB_DIR},
                )
                for _ in range(args.peer_reps)
            ]
            ok = [r for r in reps if "error" not in r]
            if not ok:
                peer.append(reps[0])
                continue
            times = [r["time_to_first_batch_s"] for r in ok]
            peer.append(
                {**ok[0], "time_to_first_batch_s": statistics.median(times), "runs_s": times}
            )
    extrapolation = None
    good = [r for r in peer if "error" not in r]
    if len(good) == 4:
        a0, a1, b0, b1 = good
        per_sample_replay = (b1["time_to_first_batch_s"] - b0["time_to_first_batch_s"]) / b1[
            "yielded"
        ]
        per_sample_perm = b0["time_to_first_batch_s"] / b0["epoch_len"]
        extrapolation = {
            "replay_s_per_sample": per_sample_replay,
            "permutation_s_per_epoch_sample": per_sample_perm,
            "incident_epoch_len": INCIDENT_EPOCH,
            "incident_yielded_at_step_3M": INCIDENT_YIELDED,
            "time_to_first_batch_at_step_0_s": per_sample_perm * INCIDENT_EPOCH,
            "time_to_first_batch_at_step_3M_s": per_sample_perm * INCIDENT_EPOCH
            + per_sample_replay * INCIDENT_YIELDED,
        }
    path = write_result(
        "loader_resume",
        {
            "command": "python bench/loader_resume.py "
            f"--reps {args.reps} --peer-reps {args.peer_reps}",
            "loadavg_at_start": load,
            "ours_runs_s": {str(k): v for k, v in runs.items()},
            "ours_median_s": ours,
            "ours_fresh_process_spread_s": ours_spread,
            "ours_in_process_spread_s": inproc_spread,
            "ours_ratio_3M_vs_0": ratio,
            "ours_ratio_paired": spread(paired),
            "torchdata": peer,
            "torchdata_extrapolation": extrapolation,
            "notes": [note],
            "wall_s": time.time() - t_start,
        },
    )
    for label, sp in (("fresh process", ours_spread), ("in process", inproc_spread)):
        print(
            f"steadytrain, {label}: first batch after resume at step 0 {ms(sp['0'])}, at "
            f"step 3,000,000 {ms(sp['3000000'])} (min / median / max)"
        )
    pr = spread(paired)
    print(
        f"ratio 3M/0 (fresh process, paired): {pr['min']:.2f} / {pr['median']:.2f} / "
        f"{pr['max']:.2f}"
    )
    for r in peer:
        if "error" in r:
            print(f"torchdata: {r['error']}")
        else:
            print(
                f"torchdata StatefulDataLoader epoch {r['epoch_len']:>9d} samples, resumed "
                f"{r['yielded']:>9d} in: {r['time_to_first_batch_s']:.2f} s"
            )
    if extrapolation:
        print(
            f"torchdata extrapolated to the incident run: {extrapolation['time_to_first_batch_at_step_0_s']:.0f} s "
            f"at step 0, {extrapolation['time_to_first_batch_at_step_3M_s']:.0f} s at step 3,000,000"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
