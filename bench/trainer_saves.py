"""How long does a save block Lightning's and the HF Trainer's loop? steadytrain's plugins
against each trainer's own checkpointing, side by side in one run, one process on CPU.

    .venv/bin/python bench/trainer_saves.py                 # 3 repetitions
    .venv/bin/python bench/trainer_saves.py --reps 5 --out /tmp/t.json
    .venv/bin/python bench/trainer_saves.py --trainers hf --every 8 --steps 26

The same model in every contender: a Llama (2 layers, hidden 768, vocab 8000, untied
embeddings: 26.5 M parameters) trained with AdamW, so the saved state (weights + two
moments) is about 318 MB (measured and written to the JSON as ``state_mib``). Each trainer
saves every ``--every`` (4) steps; steps are timed from one step's start hook to the next
(Lightning's ``on_train_batch_start``, HF's ``on_step_begin``), so a step's time includes the
saves made at its end (ModelCheckpoint's ``on_train_batch_end``, HF's ``_save_checkpoint``).
The contenders, each configured as its own docs recommend:

- Lightning: no checkpointing (the baseline), ``ModelCheckpoint(every_n_train_steps=N)``
  (Lightning's default ``TorchCheckpointIO``: ``torch.save``), the same with
  ``plugins=[AsyncCheckpointIO()]`` (Lightning's asynchronous saving), and steadytrain's
  ``SteadySingleDeviceStrategy`` under the same ``ModelCheckpoint``;
- HF: ``save_strategy="no"`` (the baseline), ``save_strategy="steps", save_steps=N`` (its
  defaults: safetensors weights, optimizer, scheduler, RNG), and ``SteadytrainTrainer``.

Per run: the first ``WARMUP`` steps are not timed; **blocked per save** is the time the
loop waits inside each save call (Lightning's ``trainer.save_checkpoint``, which
``ModelCheckpoint`` calls; HF's ``Trainer._save_checkpoint``, which ``save_strategy`` calls;
the same call for every contender of a trainer, whatever it does inside); **step-time
cost** is the run's mean step time over the timed steps against the median of its
trainer's baseline runs (what saving every N steps costs, background writes that slow the
steps beside them included); ``save_step_excess_s`` (a save step's time minus the median of
the run's other steps) is kept in the JSON as the outside view of the same loss. Contenders are interleaved (every repetition runs each once, the order rotated
by one place per repetition), each run in a fresh process; medians and ranges are over the
repetitions. The steadytrain runs also report the plugin's own ``checkpoint_block_s`` from
the ledger, as a cross-check. Each run records the host's 1-minute load average at its
start and end (``loadavg_1m``): on a shared machine the numbers move with it. Writes JSON
to bench/results/trainer_saves.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.join(HERE, ".work", "trainer_saves")
OUT = os.path.join(HERE, "results", "trainer_saves.json")
WARMUP, SEQ, MICRO = 2, 32, 1
CONTENDERS = {
    "lightning": ["none", "modelcheckpoint", "async_checkpoint_io", "steadytrain"],
    "hf": ["none", "save_strategy", "steadytrain"],
}


def _llama(vocab: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=768, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _state_mib(model: Any, optim: Any) -> float:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optim.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if hasattr(v, "numel"))
    return n / 2**20


def _timed(obj: Any, name: str, sink: list[float]) -> None:
    """Time every call of ``obj.name`` (an instance attribute shadowing the method): the
    seconds the training loop waits for it."""
    fn = getattr(obj, name)

    def call(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, call)


def _lightning(
    kind: str, ds: Any, work: str, steps: int, every: int, times: list, saves: list
) -> float:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader

    from steadytrain import TokenLoader
    from steadytrain.integrations.lightning_steady import SteadySingleDeviceStrategy

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama(ds.vocab_size)

        def training_step(self, batch: dict, _i: int) -> Any:
            ids = batch["input_ids"]
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            times.append(time.perf_counter())

        def on_train_end(self, *a: Any) -> None:
            times.append(time.perf_counter())

    loader = TokenLoader(ds, seq_len=SEQ, global_batch=MICRO, micro_batch=MICRO, seed=0)
    callbacks: list[Any] = [Clock()]
    kw: dict[str, Any] = {"strategy": "auto", "plugins": None}
    if kind != "none":
        callbacks.append(ModelCheckpoint(os.path.join(work, "ckpt"), every_n_train_steps=every))
    if kind == "async_checkpoint_io":
        kw["plugins"] = [AsyncCheckpointIO()]
    if kind == "steadytrain":
        kw["strategy"] = SteadySingleDeviceStrategy(os.path.join(work, "run"), loader=loader)
    model = LM()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
        enable_checkpointing=kind != "none", enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=work, **kw,
    )  # fmt: skip
    _timed(trainer, "save_checkpoint", saves)  # what ModelCheckpoint calls, whoever saves
    trainer.fit(model, DataLoader(loader.as_dataset(), batch_size=None))
    loader.close()
    return _state_mib(model, trainer.optimizers[0])


def _hf(kind: str, ds: Any, work: str, steps: int, every: int, times: list, saves: list) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from steadytrain import TokenLoader, TokenWindows
    from steadytrain.integrations.hf_steady import SteadytrainTrainer

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter())

        def on_train_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter())

    saving = {"save_strategy": "no"} if kind == "none" else {"save_strategy": "steps"}
    args = TrainingArguments(
        output_dir=os.path.join(work, "out"), max_steps=steps, save_steps=every,
        per_device_train_batch_size=MICRO, learning_rate=1e-4, logging_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, **saving,
    )  # fmt: skip
    model = _llama(ds.vocab_size)
    if kind == "steadytrain":
        loader = TokenLoader(ds, seq_len=SEQ, global_batch=MICRO, micro_batch=MICRO, seed=0)
        trainer: Any = SteadytrainTrainer(model, args, loader=loader, callbacks=[Clock()])
    else:
        data = TokenWindows(ds, SEQ)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[Clock()])
    _timed(trainer, "_save_checkpoint", saves)  # what save_strategy calls, whoever saves
    trainer.train()
    return _state_mib(model, trainer.optimizer)


def _ledger_blocks(work: str) -> list[float]:
    """The steadytrain plugin's own checkpoint_block_s of each step that saved."""
    for path in (os.path.join(work, "run"), os.path.join(work, "out", "steadytrain")):
        ledger = os.path.join(path, "ledger.jsonl")
        if os.path.exists(ledger):
            recs = [json.loads(line) for line in open(ledger)]
            return [
                r["checkpoint_block_s"]
                for r in recs
                if r.get("type") == "step" and r.get("checkpoint_block_s")
            ]
    return []


def worker(trainer: str, kind: str, ds_dir: str, work: str, steps: int, every: int) -> dict:
    import torch

    from steadytrain import TokenDataset

    torch.set_num_threads(1)
    load = os.getloadavg()[0]  # the host's load: the machine is shared, so it is reported
    ds = TokenDataset.open(ds_dir)
    times: list[float] = []
    blocked: list[float] = []
    run = _lightning if trainer == "lightning" else _hf
    state = run(kind, ds, work, steps, every, times, blocked)
    # times[i]: the start of step i+1; the last entry the end of training
    dur = {i + 1: times[i + 1] - times[i] for i in range(len(times) - 1)}
    timed = {s: d for s, d in dur.items() if s > WARMUP}
    saves = {s: d for s, d in timed.items() if kind != "none" and s % every == 0}
    plain = [d for s, d in timed.items() if s not in saves]
    return {
        "trainer": trainer,
        "kind": kind,
        "state_mib": round(state, 1),
        "step_s": [round(d, 4) for _, d in sorted(timed.items())],
        "mean_step_s": statistics.fmean(timed.values()),
        "blocked_per_save_s": blocked,
        # the save step's time minus the median step without a save: the same loss seen
        # from outside (it also counts what a save's background work costs its own step)
        "save_step_excess_s": [d - statistics.median(plain) for d in saves.values()],
        "ledger_block_s": _ledger_blocks(work),
        "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }


def _dataset(root: str) -> str:
    import numpy as np

    from steadytrain.data.ingest.writer import DatasetWriter

    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    rng = np.random.default_rng(0)
    with DatasetWriter(root, vocab_size=8000, eos_id=0, tokenizer={"type": "bench"}) as w:
        lengths = rng.integers(100, 2000, size=400)
        tokens = rng.integers(1, 8000, size=int(lengths.sum()))
        tokens[np.cumsum(lengths) - 1] = 0
        w.add_documents(tokens, lengths)
    return root


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def summarize(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for trainer, kinds in CONTENDERS.items():
        mine = [r for r in runs if r["trainer"] == trainer]
        if not mine:
            continue  # --trainers left it out
        base = statistics.median(r["mean_step_s"] for r in mine if r["kind"] == "none")
        rows = {}
        for kind in kinds:
            rs = [r for r in mine if r["kind"] == kind]
            row: dict[str, Any] = {"mean_step_s": _spread([r["mean_step_s"] for r in rs])}
            if kind != "none":
                # per run: the median of its saves; the spread is over the repetitions
                row["blocked_per_save_s"] = _spread(
                    [statistics.median(r["blocked_per_save_s"]) for r in rs]
                )
                row["step_cost"] = _spread([r["mean_step_s"] / base - 1 for r in rs])
            if kind == "steadytrain":
                row["ledger_block_s"] = _spread(
                    [statistics.median(r["ledger_block_s"]) for r in rs if r["ledger_block_s"]]
                )
            rows[kind] = row
        ours = rows["steadytrain"]["blocked_per_save_s"]["median"]
        out[trainer] = {
            "contenders": rows,
            "blocked_ratio_vs": {
                k: ours / rows[k]["blocked_per_save_s"]["median"]
                for k in kinds
                if k not in ("none", "steadytrain")
            },
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--trainers", nargs="+", choices=sorted(CONTENDERS), default=list(CONTENDERS))
    ap.add_argument("--worker", nargs=2, metavar=("TRAINER", "KIND"))
    ap.add_argument("--work", default=WORK)
    a = ap.parse_args()
    ds_dir = os.path.join(WORK, "ds")
    if a.worker:
        res = worker(*a.worker, ds_dir, a.work, a.steps, a.every)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    os.makedirs(WORK, exist_ok=True)
    _dataset(ds_dir)
    order = [(t, k) for t, kinds in CONTENDERS.items() if t in a.trainers for k in kinds]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    runs = []
    for rep in range(a.reps):
        rot = order[rep % len(order) :] + order[: rep % len(order)]
        for trainer, kind in rot:
            work = os.path.join(WORK, f"{trainer}-{kind}")
            shutil.rmtree(work, ignore_errors=True)
            cmd = [sys.executable, __file__, "--worker", trainer, kind, "--work", work]
            cmd += ["--steps", str(a.steps), "--every", str(a.every)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                raise SystemExit(f"{trainer}/{kind} failed:\n{p.stderr[-4000:]}")
            res = json.loads(line[-1][len("RESULT ") :]) | {"rep": rep}
            print(json.dumps({k: res[k] for k in ("trainer", "kind", "rep", "mean_step_s")}))
            runs.append(res)
            shutil.rmtree(work, ignore_errors=True)
    lo = [r["loadavg_1m"][0] for r in runs]
    hi = [r["loadavg_1m"][1] for r in runs]
    doc = {
        "what": "time a save blocks the training loop, trainer plugins vs the trainers' own",
        "steps": a.steps, "every": a.every, "warmup": WARMUP, "seq_len": SEQ,
        "micro_batch": MICRO, "reps": a.reps, "cpu_threads": 1, "cpus": os.cpu_count(),
        "loadavg_1m": {"min": min(lo), "max": max(hi)},
        "versions": _versions(), "summary": summarize(runs), "runs": runs,
    }  # fmt: skip
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc["summary"], indent=1))
    return 0


def _versions() -> dict:
    import lightning
    import torch
    import transformers

    return {"torch": torch.__version__, "lightning": lightning.__version__,
            "transformers": transformers.__version__}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
