"""The HF Trainer recipe of ``steadytrain.integrations.hf`` (its module docstring, and the
same code in docs/training.md), extracted and run as written: a tiny random-init Llama is
the ``model`` the recipe is given, "my-dataset" a real steadytrain dataset.

It trains 20 steps with checkpoints at 10 and 20; with checkpoint 20 removed (as if the job
had died before it), a second run resumes from 10 and ends at 20 again. The ledger shows both
attempts, the second restored at step 10, each step with its loss. A ``TokenLoader``'s
``as_dataset()`` given as the Trainer's data is refused at ``on_train_begin`` with the fix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
"""


def docstring_recipe() -> str:
    """The indented block after the docstring's first ``::``."""
    # Imported here, not at the top: the module imports transformers (1-2 s of CPU), which
    # every test process would pay at collection, the inner loop's too (this file is e2e).
    import steadytrain.integrations.hf as hf

    doc = hf.__doc__ or ""
    body = doc.split("::\n", 1)[1]
    lines = []
    for line in body.splitlines()[1:]:
        if line and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines)).strip() + "\n"


def docs_recipe() -> str:
    with open(os.path.join(REPO, "docs", "training.md")) as f:
        text = f.read()
    m = re.search(r"```python\n(import os\nfrom transformers import Trainer.*?)```", text, re.S)
    assert m, "docs/training.md lost its HF Trainer recipe"
    return m.group(1).strip() + "\n"


def test_hf_recipe_runs_as_written_and_resumes(dataset: str, tmp_path) -> None:
    from steadytrain.monitor.ledger import read_ledger

    code = docstring_recipe()
    assert "TokenWindows(TokenDataset.open(" in code, code
    assert docs_recipe() == code, "docs/training.md and the docstring give different recipes"
    shutil.copytree(dataset, tmp_path / "my-dataset")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run() -> None:
        proc = subprocess.run(
            [sys.executable, "-c", MODEL + code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    run()
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-20", "steadytrain"]
    shutil.rmtree(out / "checkpoint-20")
    run()  # resumes from checkpoint-10
    assert (out / "checkpoint-20").is_dir()
    recs = read_ledger(str(out / "steadytrain" / "ledger.jsonl"))
    starts = [r["restored_step"] for r in recs if r["type"] == "job_start"]
    ends = [r["reason"] for r in recs if r["type"] == "job_end"]
    assert starts == [0, 10] and ends == ["finished", "finished"], (starts, ends)
    steps = [r for r in recs if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21)) + list(range(11, 21))
    assert all(isinstance(r["loss"], float) and r["tokens"] == 8 * 64 for r in steps)


def test_a_token_loader_as_the_trainers_data_is_refused_with_the_fix(dataset, tmp_path):
    from transformers import Trainer, TrainingArguments

    import steadytrain.integrations.hf as hf
    from steadytrain import TokenDataset, TokenLoader
    from steadytrain.errors import ConfigError

    loader = TokenLoader(TokenDataset.open(dataset), seq_len=32, global_batch=4, micro_batch=2)
    given: dict = {}
    exec(MODEL, given)  # the recipe's model
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2)
    trainer = Trainer(
        given["model"],
        args,
        train_dataset=loader.as_dataset(),
        callbacks=[hf.SteadytrainCallback(str(tmp_path / "run"))],
    )
    with pytest.raises(ConfigError, match=r"batch them again .*train_dataset=TokenWindows\("):
        trainer.train()
    assert not os.path.exists(tmp_path / "run" / "ledger.jsonl")  # refused before any record
    loader.close()
