"""Resume cost: time to first batch after restoring at step 3,000,000 vs step 0.

steadytrain: the 11T-token sparse dataset (11,000 shards), global batch 576, seq 4096, rank 0
of 8, micro-batch 8, global shuffle; each measurement in a fresh process (import and dataset
open excluded, loader construction + load_state_dict + first batch included), 3 runs each,
alternating, median reported. Peer: torchdata StatefulDataLoader (the peer that can resume)
over a Megatron-style map dataset, restored at 0 and at 3/4 of an epoch of 4 Mi and 16 Mi
samples; its RandomSampler rebuilds the epoch's permutation and replays the samples already
yielded, so the cost grows with the epoch and the position in it (extrapolated to the
incident run's 2.7e9-sample epoch, 1.7e9 samples in at step 3,000,000).

    .venv/bin/python bench/loader_resume.py   -> bench/results/loader_resume.json
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


def child(data: str, step: int) -> dict:
    from steadytrain.data.read.dataset import TokenDataset
    from steadytrain.data.read.loader import TokenLoader

    ds = TokenDataset.open(data)
    probe = TokenLoader(ds, SEQ, G, MICRO, rank=0, world_size=WORLD, seed=0)
    state = probe.state_dict()
    state.update(step=step, position=step * G)
    t0 = time.perf_counter()
    loader = TokenLoader(ds, SEQ, G, MICRO, rank=0, world_size=WORLD, seed=0)
    loader.load_state_dict(state)
    batch = next(loader)
    elapsed = time.perf_counter() - t0
    loader.close()
    return {
        "step": step,
        "time_to_first_batch_s": elapsed,
        "first_sample": int(batch["sample_ids"][0]),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
        return
    t_start = time.time()
    data = make_sparse_11t()
    runs: dict[int, list[float]] = {0: [], 3_000_000: []}
    for _ in range(3):
        for step in runs:
            r = run_json([sys.executable, __file__, "--child", data, str(step)], 120)
            runs[step].append(r["time_to_first_batch_s"])
    ours = {str(k): statistics.median(v) for k, v in runs.items()}
    ratio = ours["3000000"] / ours["0"]
    py, note = ensure_peer_env()
    peer = []
    small = make_dataset("tp32m", 32 << 20)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "loader_peers.py")
    for epoch in (1 << 22, 1 << 24):
        for yielded in (0, epoch * 3 // 4):
            if py is None:
                peer.append({"epoch_len": epoch, "yielded": yielded, "error": note})
                continue
            peer.append(
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
            "ours_runs_s": {str(k): v for k, v in runs.items()},
            "ours_median_s": ours,
            "ours_ratio_3M_vs_0": ratio,
            "torchdata": peer,
            "torchdata_extrapolation": extrapolation,
            "notes": [note],
            "wall_s": time.time() - t_start,
        },
    )
    print(
        f"steadytrain: first batch after resume at step 0 {ours['0'] * 1e3:.1f} ms, at step "
        f"3,000,000 {ours['3000000'] * 1e3:.1f} ms: ratio {ratio:.2f} (target <= 1.1)"
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
