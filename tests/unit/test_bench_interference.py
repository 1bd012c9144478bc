"""The interference benchmark measures what it claims: its step time sees a background
thread that holds the GIL, and its checkpoint contender really keeps a save in flight.

A step timer blind to GIL waits would report 0 % for any background thread; a contender
whose saves never started would report the baseline as "checkpoint thread".
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import threading

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the step timer reads Linux's schedstat"
)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_interference", f"{BENCH}/interference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _blocked_ms(bench, trainer, batches, steps: int = 4) -> float:
    return 1e3 * statistics.median(trainer.step(batches)["blocked"] for _ in range(steps))


def test_step_timer_sees_a_thread_that_holds_the_gil(bench):
    torch.set_num_threads(1)
    trainer = bench.Trainer()
    x = torch.randint(0, 257, (bench.MICRO, bench.SEQ))
    batches = iter(lambda: {"input_ids": x, "labels": x}, None)
    trainer.step(batches)  # first-step allocations out of the way
    alone = _blocked_ms(bench, trainer, batches)
    stop = threading.Event()

    def spin() -> None:  # pure Python: holds the GIL until the interpreter switches
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        beside = _blocked_ms(bench, trainer, batches)
    finally:
        stop.set()
        t.join()
    assert beside > 1.0, f"a GIL-holding thread cost the step only {beside:.2f} ms"
    assert beside > 3 * alone, (alone, beside)


def test_checkpoint_contender_keeps_a_save_in_flight(bench, tmp_path):
    trainer = bench.Trainer()
    ballast = torch.nn.Module()
    ballast.register_buffer("t", torch.randn(1 << 18))  # 1 MiB
    contender = bench.Contender("ckpt_thread", trainer, None, str(tmp_path), ballast)
    try:
        got = contender.run(warmup=0, steps=4)
    finally:
        contender.close()
    assert got["saves"] >= 1  # the first timed step already ran beside a save
    events = [e for e in contender.events if e["type"] == "checkpoint"]
    assert len(events) == contender.saves and all(e["ok"] for e in events)
    root = tmp_path / "ckpt_thread"
    assert any((d / "COMMIT").exists() for d in root.iterdir() if d.is_dir())
