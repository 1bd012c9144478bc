"""Every ```python block of README.md and docs/*.md runs here, as written.

A documented call must not crash (issue 27: a sample in docs/monitoring.md raised
``TypeError`` for months). Each block runs in its own Python process, after a *prelude*
that supplies only the names the prose says the reader already has (``model``, ``rank``,
``loader``, a real dataset ...), and is followed by a *check* that asserts what the block
promises (a batch of the documented shape, a committed checkpoint, a fingerprint that
matches). The only edits made to a block's text are the placeholders a reader replaces
(a bucket URL, a cache directory), listed in ``Sample.replace``.

A new block with no entry in ``SAMPLES`` fails ``test_every_python_block_has_a_fixture``:
give it a prelude and a check, or, if it is not Python (a signature listing), fence it as
``text``. This module sits in tests/s3 because two samples read a dataset from object
storage: they run against the suite's SeaweedFS server.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from steadytrain.data.ingest.writer import DatasetWriter
from steadytrain.storage.store import Store
from steadytrain.testing import forkserver

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]


def python_blocks() -> list[tuple[str, int, str]]:
    """``(file relative to the repo, first line of the block, code)`` for every block."""
    out = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start, body = i + 2, []
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                out.append((str(path.relative_to(REPO)), start, "\n".join(body) + "\n"))
            i += 1
    return out


# -- preludes: the names a reader of each section already has ----------------------------
_MODEL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(ds.vocab_size, 16), torch.nn.Linear(16, ds.vocab_size))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""
_LOCAL_DS = """
from steadytrain import TokenDataset, TokenLoader
ds = TokenDataset.open(os.environ["SAMPLE_DATASET"])
"""
_LOADER = """
loader = TokenLoader(ds, seq_len=32, global_batch=8, micro_batch=4, labels="next")
"""

# After a trainer recipe: steadytrain's Checkpointer committed ModelCheckpoint's / save_steps'
# steps 3 and 6 (keep_last=2), and the ledger booked both saves as checkpoint blocking.
_TRAINER_SAVED = """
from steadytrain.checkpoint.inspect import list_checkpoints
rows = list_checkpoints("{ckpts}")
assert [r["step"] for r in rows if r["state"] == "committed" and r["verifies"]] == [6, 3], rows
recs = [json.loads(l) for l in open("{ledger}")]
assert [r["step"] for r in recs if r["type"] == "step"] == [1, 2, 3, 4, 5, 6], recs
assert [r["step"] for r in recs if r["type"] == "step" and r.get("checkpoint_block_s")] == [3, 6]
assert recs[-1]["type"] == "job_end", recs[-1]
"""


@dataclass
class Sample:
    """How one block runs: the file it lives in, a regex its code matches, the prelude
    before it, the check after it, and the reader's placeholders to fill in."""

    file: str
    match: str
    prelude: str = ""
    check: str = ""
    replace: dict[str, str] = field(default_factory=dict)
    covered_by: str = ""  # another test extracts and runs this very block
    marks: tuple = ()  # e.g. the node harness: it runs in the suite's machine group


SAMPLES = [
    Sample(
        "README.md",
        r'TokenDataset\.open\("s3://bucket/ds"',
        prelude="import torch\nrank, world = 0, 1\n"
        "model = torch.nn.Linear(4, 4)\noptim = torch.optim.SGD(model.parameters(), lr=0.1)\n",
        check="""
assert batch["input_ids"].shape == (8, 2048) and batch["labels"].shape == (8, 2048)
assert batch["sample_ids"].shape == (8,)
assert json.loads(json.dumps(sd)) == sd
assert step == 0
""",
        replace={"s3://bucket/ds": "{url}", "/nvme/steady-cache": "{cache}"},
    ),
    Sample(
        "README.md",
        r"for step in range\(run\.start_step \+ 1, 201\)",
        covered_by="tests/integrations/test_readme_plain_pytorch.py",
    ),
    Sample(
        "docs/training.md",
        r'TokenWindows\(TokenDataset\.open\("my-dataset"\), seq_len=64\)',
        covered_by="tests/integrations/test_hf_recipe.py",
    ),
    Sample(
        "docs/training.md",
        r"SteadySingleDeviceStrategy\(\"runs/lt\", loader=loader",
        prelude=_LOCAL_DS
        + """
import torch, lightning as L
torch.manual_seed(0)
class LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(5000, 16), torch.nn.Linear(16, 5000))
    def training_step(self, batch, _):
        return torch.nn.functional.cross_entropy(
            self.net(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
model = LM()
""",
        check=_TRAINER_SAVED.format(ckpts="runs/lt/checkpoints", ledger="runs/lt/ledger.jsonl")
        + "assert trainer.global_step == 6\n",
        replace={'"my-dataset"': 'os.environ["SAMPLE_DATASET"]'},
    ),
    Sample(
        "docs/training.md",
        r"SteadytrainTrainer\(model, args, loader=loader",
        prelude="""
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=5000, n_positions=32, n_embd=32, n_layer=1,
                                   n_head=2))
""",
        check=_TRAINER_SAVED.format(
            ckpts="out-hf/steadytrain/checkpoints", ledger="out-hf/steadytrain/ledger.jsonl"
        )
        + "assert trainer.state.global_step == 6 and not os.path.exists('out-hf/checkpoint-3')\n",
        replace={'"my-dataset"': 'os.environ["SAMPLE_DATASET"]'},
    ),
    Sample(
        "docs/checkpoint.md",
        r'Checkpointer\("ckpts/", every_steps=100, keep_last=3, keep_every=1000',
        prelude=_LOCAL_DS
        + _MODEL
        + _LOADER
        + """
from steadytrain import GoodputMeter
meter = GoodputMeter("run", sinks=("jsonl",))
sched = torch.optim.lr_scheduler.StepLR(optim, 10)
total_steps, tokens = 100, 0
""",
        check="""
meter.close()
from steadytrain.checkpoint.inspect import list_checkpoints
rows = list_checkpoints("ckpts")
assert [r["step"] for r in rows if r["state"] == "committed" and r["verifies"]] == [100], rows
assert any(json.loads(l)["type"] == "checkpoint" for l in open("run/ledger.jsonl"))
""",
    ),
    Sample(
        "docs/checkpoint.md",
        r'memory=\{"every_steps": 1, "dir": "mem/"\}\)\nfor step',
        prelude=_LOCAL_DS + _MODEL + _LOADER,
        check="""
ev = after.last_event
assert ev["type"] == "restore" and ev["tier"] == "local-memory" and ev["step"] == 6, ev
import glob
assert glob.glob("mem/*/rank00000/step-000000006.snap"), os.listdir("mem")
""",
    ),
    Sample(
        "docs/format.md",
        r"canonical = json\.dumps\(obj",
        prelude="""
import json, xxhash
m = json.load(open(os.environ["SAMPLE_DATASET"] + "/manifest.json"))
# the object docs/format.md A.4 spells out just above the block
obj = {"dtype": m["dtype"], "eos_id": m["eos_id"], "format": m["format"],
       "fingerprint_version": m["fingerprint_version"],
       "shards": [[s["tokens"], s["docs"], s["checksum"], s["index"]["checksum"]]
                  for s in m["shards"]],
       "version": m["version"], "vocab_size": m["vocab_size"]}
""",
        check='assert fingerprint == m["fingerprint"], (fingerprint, m["fingerprint"])\n',
    ),
    Sample(
        "docs/format.md",
        r"def read_dataset\(root\)",
        check="""
from steadytrain import TokenDataset
root = os.environ["SAMPLE_DATASET"]
docs = list(read_dataset(root))
ds = TokenDataset.open(root)
assert len(docs) == ds.num_docs and sum(len(d) for d in docs) == ds.num_tokens
assert all(int(d[-1]) == ds.eos_id for d in docs)
""",
    ),
    Sample(
        "docs/loader.md",
        r'TokenDataset\.open\("s3://bucket/ds"',
        prelude="import torch\nrank, world = 0, 1\n",
        check="""
assert batch["input_ids"].shape == (8, 2048) and batch["input_ids"].dtype == torch.int64
assert batch["labels"].shape == (8, 2048) and batch["sample_ids"].shape == (8,)
loader2 = TokenLoader(ds, seq_len=2048, global_batch=512, micro_batch=8,
                      rank=rank, world_size=world, seed=0, shuffle="global", num_workers=0)
loader2.load_state_dict(json.loads(json.dumps(sd)))
assert torch.equal(next(loader2)["sample_ids"], next(loader)["sample_ids"])
""",
        replace={"s3://bucket/ds": "{url}", "/nvme/steady-cache": "{cache}"},
    ),
    Sample(
        "docs/loader.md",
        r"\(out\.loss / loader\.micro_per_step\)\.backward\(\)",
        prelude=_LOCAL_DS
        + """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(vocab_size=ds.vocab_size, n_positions=32, n_embd=32,
                                   n_layer=1, n_head=2))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = TokenLoader(ds, seq_len=32, global_batch=8, micro_batch=4)
before = [p.detach().clone() for p in model.parameters()]
""",
        check="""
assert loader.step == 1
assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
""",
    ),
    Sample(
        "docs/monitoring.md",
        r"meter = GoodputMeter\(run_dir, rank=rank",
        prelude=_LOCAL_DS
        + _MODEL
        + _LOADER
        + """
import time
from steadytrain import Checkpointer
from steadytrain.redact import redact
run_dir, rank, world, total_steps = "run", 0, 1, 3
global_batch, seq_len = 8, 32
states = {"model": model, "optim": optim, "loader": loader}
cfg = {"data": {"dataset": "s3://KEY:SECRET@bucket/ds"}}
startup_s, restore_s = 0.5, 0.0
it = loader
def train_step(batch):
    loss = torch.nn.functional.cross_entropy(
        model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
    loss.backward(); optim.step(); optim.zero_grad()
    return loss
""",
        check="""
recs = [json.loads(l) for l in open("run/ledger.jsonl")]
steps = [r["step"] for r in recs if r["type"] == "step"]
assert steps == [1, 2, 3], steps
assert "SECRET" not in open("run/ledger.jsonl").read()
""",
        replace={'sinks=("jsonl", "mlflow", "console")': 'sinks=("jsonl",)'},
    ),
    Sample(
        "docs/monitoring.md",
        r'with run\.phase\("eval"\)',
        check="""
recs = [json.loads(l) for l in open("runs/eval/ledger.jsonl")]
assert [r["step"] for r in recs if r["type"] == "step"] == [1, 2, 3], recs
assert recs[-1]["type"] == "job_end" and recs[-1]["reason"] == "finished", recs[-1]
""",
    ),
    Sample(
        "docs/testing.md",
        r"with NodeHarness\(tmp_dir, nodes=2",
        prelude="""
import sys
tmp_dir, dataset_dir = "harness", os.environ["SAMPLE_DATASET"]
""",
        check="""
assert h.leftovers() == [], h.leftovers()
""",
        marks=(pytest.mark.nodes,),
    ),
    Sample(
        "docs/planning.md",
        r"restart_plan\.scaled_profile\(16384\)",
        check="""
assert abs(sum(loss.values()) - (1 - best["goodput"])) < 1e-9, loss
assert costs.restart_s == sum(phases.values()) and costs.durable_restore_s == 480.0
# as the prose says: 98 % is out of reach from the restart alone at these costs
assert goal["scale"] is None and best["goodput"] < goal["free_restarts_goodput"] < 0.98, goal
""",
    ),
    Sample(
        "docs/storage.md",
        r"Prefetcher\.for_loader\(loader, ranks=node_ranks",
        prelude="""
from steadytrain import TokenDataset, TokenLoader
ds = TokenDataset.open("{url}", cache_dir="{cache}")
loader = TokenLoader(ds, seq_len=2048, global_batch=16, micro_batch=8)
node_ranks = [0]
""",
        check="""
assert pf is not None
batch = next(loader)
assert batch["input_ids"].shape == (8, 2048)
""",
    ),
]


def find_sample(file: str, code: str) -> Sample | None:
    hits = [s for s in SAMPLES if s.file == file and re.search(s.match, code)]
    assert len(hits) <= 1, f"{file}: more than one fixture matches a block: {hits}"
    return hits[0] if hits else None


BLOCKS = python_blocks()


def _param(file: str, line: int, code: str):  # noqa: ANN202 - pytest's ParameterSet
    sample = find_sample(file, code)
    return pytest.param(file, line, code, id=f"{file}:{line}", marks=sample.marks if sample else ())


def test_every_python_block_has_a_fixture() -> None:
    missing = [f"{f}:{line}" for f, line, code in BLOCKS if find_sample(f, code) is None]
    assert not missing, (
        f"docs sample(s) with no fixture in {__file__}: {missing}; add a Sample (prelude and "
        "check) so the block runs in the suite, or fence it as text if it is not Python"
    )
    used = {id(find_sample(f, code)) for f, _, code in BLOCKS}
    stale = [s.file + " " + s.match for s in SAMPLES if id(s) not in used]
    assert not stale, f"fixtures whose block is gone from the docs: {stale}"


def test_covered_blocks_are_extracted_by_their_test() -> None:
    for s in SAMPLES:
        if s.covered_by:
            text = (REPO / s.covered_by).read_text(encoding="utf-8")
            assert "```python" in text and s.file in text, (s.covered_by, s.file)


# Session fixtures (one per worker: a second or two), not module ones: a module fixture keeps
# every sample on one worker, one after another (tests/conftest.py), and the samples are
# the slowest tests of the inner loop. The samples only read the dataset.
@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> str:
    """A real dataset big enough for the README's global batch of 512 x 2048 tokens."""
    root = tmp_path_factory.mktemp("docs-ds")
    rng = np.random.default_rng(0)
    with DatasetWriter(
        str(root), vocab_size=5000, eos_id=0, tokenizer={"type": "test"}, shard_tokens=400_000
    ) as w:
        lengths = rng.integers(200, 4000, size=600)
        tokens = rng.integers(1, 5000, size=int(lengths.sum()))
        tokens[np.cumsum(lengths) - 1] = 0
        w.add_documents(tokens, lengths)
    return str(root)


@pytest.fixture(scope="session")
def remote_dataset(sample_dataset, s3_server) -> str:
    url = "s3://steady/docs-samples/ds"
    store = Store(url, storage_options=s3_server.storage_options)
    root = Path(sample_dataset)
    for p in sorted(f for f in root.rglob("*") if f.is_file()):  # the manifest last
        if p.name != "manifest.json":
            store.put_file(str(p), p.relative_to(root).as_posix())
    store.put_file(str(root / "manifest.json"), "manifest.json")
    return url


@pytest.mark.parametrize("file,line,code", [_param(*b) for b in BLOCKS])
def test_docs_sample_runs(file, line, code, sample_dataset, remote_dataset, s3_server, tmp_path):
    sample = find_sample(file, code)
    if sample is None:
        pytest.fail(f"{file}:{line} has no fixture (see test_every_python_block_has_a_fixture)")
    if sample.covered_by:
        return  # run, as extracted, by sample.covered_by (checked above)
    fill = {"url": remote_dataset, "cache": str(tmp_path / "cache")}
    for old, new in sample.replace.items():
        assert old in code, f"{file}:{line}: placeholder {old!r} is gone from the block"
        code = code.replace(old, new.format(**fill))
    prelude = "import json, os\n" + sample.prelude.replace("{url}", fill["url"]).replace(
        "{cache}", fill["cache"]
    )
    script = prelude + "\n# ---- the block, as documented ----\n" + code + "\n" + sample.check
    script += "\nprint('SAMPLE-OK')\n"
    env = dict(os.environ, SAMPLE_DATASET=sample_dataset, OMP_NUM_THREADS="1", **s3_server.env())
    # Forked from the fork server (torch imported once per worker, not once per sample):
    # the blocks are about what they call, not about start-up.
    proc = forkserver.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env, timeout=240)
    assert proc.returncode == 0 and "SAMPLE-OK" in proc.stdout, (
        f"{file}:{line} failed:\n{textwrap.indent(proc.stderr[-4000:], '  ')}"
    )
