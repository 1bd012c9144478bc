"""``steadytrain export``: a default checkpoint becomes readable by stock tools.

A real ``Checkpointer`` writes with its defaults (raw tensor records); the CLI exports it;
a separate Python process that never imports steadytrain reads the export with DCP's stock
``dcp.load`` and ``dcp_to_torch_save``, ``torch.load``, ``safetensors.torch.load_file`` and
Hugging Face ``from_pretrained``, and every tensor is bit-equal to the one saved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from steadytrain import Checkpointer
from steadytrain.testing import forkserver

CLI = os.path.join(os.path.dirname(sys.executable), "steadytrain")


class Loader:
    """Stands in for TokenLoader: a JSON state."""

    def __init__(self) -> None:
        self.cursor = 48

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": 7}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor = sd["cursor"]


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    m[2].to(torch.bfloat16)  # two dtypes in one state
    m.register_buffer("counts", torch.arange(5, dtype=torch.int64))
    return m


def _train_and_save(root: str, steps: tuple[int, ...] = (3,), **kw: str) -> dict:
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    ckpt = Checkpointer(root, **kw)  # the defaults: raw records, thread mode
    states = {"model": model, "optim": optim, "sched": sched, "loader": Loader()}
    for step in steps:
        x = torch.randn(4, 8)
        model[2](model[1](model[0](x)).to(torch.bfloat16)).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        ckpt.save(step, states, tokens_seen=step * 100)
    ckpt.close()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {
            str(i): {k: v.clone() for k, v in s.items()}
            for i, s in enumerate(optim.state[p] for p in model.parameters())
        },
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("export")
    root = str(tmp / "ckpts")
    ref = _train_and_save(root)
    torch.save(ref, tmp / "ref.pt")
    return {"tmp": tmp, "root": root, "ckpt": os.path.join(root, "step-00000003")}


def _export(*args: str) -> subprocess.CompletedProcess:
    return forkserver.run([CLI, "export", *args], timeout=300)


def _stock(tmp: Path, body: str) -> str:
    """Run ``body`` in a fresh Python that never imports steadytrain; its stdout."""
    script = tmp / "stock_reader.py"
    script.write_text(
        "import sys, torch\n"
        + textwrap.dedent(body)
        + "\nassert 'steadytrain' not in sys.modules, 'the reader imported steadytrain'\n"
        + "print('READ OK')\n"
    )
    out = forkserver.run([sys.executable, str(script)], timeout=300, cwd=str(tmp))
    assert out.returncode == 0 and "READ OK" in out.stdout, out.stdout + out.stderr[-3000:]
    return out.stdout


_MODEL = """
from torch import nn
def model():
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    m[2].to(torch.bfloat16)
    m.register_buffer("counts", torch.zeros(5, dtype=torch.int64))
    return m
def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bits = lambda t: t.reshape(-1).view(torch.uint8)  # bit-equal: NaNs and -0.0 too
    assert torch.equal(bits(a), bits(b)), what
ref = torch.load("ref.pt")
"""


def test_stock_dcp_refuses_the_default_format(saved) -> None:
    """Why export exists: DCP's own reader fails on the default checkpoint."""
    script = saved["tmp"] / "refuse.py"
    script.write_text(
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"dcp_to_torch_save({saved['ckpt']!r}, 'x.pt')\n"
    )
    out = forkserver.run([sys.executable, str(script)], cwd=str(saved["tmp"]))
    assert out.returncode != 0 and "raw@steadytrain" in out.stderr


def test_dcp_export_read_by_dcp_load_and_dcp_to_torch_save(saved) -> None:
    tmp, dest = saved["tmp"], saved["tmp"] / "plain-dcp"
    out = _export(saved["root"], "--to", "dcp", "--out", str(dest), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["source"] == saved["ckpt"] and result["step"] == 3 and result["to"] == "dcp"
    assert result["tensors"] == 7 + 6 * 3 and result["out"] == str(dest)  # model, AdamW
    assert not [n for n in os.listdir(tmp) if ".tmp-" in n], "a temporary export was left"
    _stock(
        tmp,
        _MODEL
        + """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
m = model()
sd = {"model": m.state_dict()}
dcp.load(sd, checkpoint_id="plain-dcp")
for k, v in ref["model"].items():
    same(m.state_dict()[k], v, k)
dcp_to_torch_save("plain-dcp", "full.pt")
full = torch.load("full.pt", weights_only=False)
for k, v in ref["model"].items():
    same(full["model"][k], v, k)
names = [n for n, _ in model().named_parameters()]
for i, per_param in ref["optim"].items():
    for k, v in per_param.items():
        same(full["optim"]["state"][names[int(i)]][k], v, f"optim {names[int(i)]} {k}")
lr = full["optim"]["param_groups"][0]["lr"]
assert lr == 1e-3, lr
extra = full["_steadytrain"]
assert extra["step"] == 3 and extra["tokens_seen"] == 300 and extra["world_size"] == 1
assert extra["ranks"][0]["states"]["loader"] == {"cursor": 48, "seed": 7}
assert extra["ranks"][0]["states"]["sched"]["last_epoch"] == 1
""",
    )


def test_torch_save_format_exports_too(tmp_path) -> None:
    """A ``tensor_format="torch_save"`` checkpoint (DCP's archives, copied record by record)."""
    ref = _train_and_save(str(tmp_path / "ckpts"), tensor_format="torch_save")
    torch.save(ref, tmp_path / "ref.pt")
    out = _export(str(tmp_path / "ckpts"), "--to", "dcp", "--out", str(tmp_path / "plain-dcp"))
    assert out.returncode == 0, out.stderr
    _stock(
        tmp_path,
        _MODEL
        + """
import torch.distributed.checkpoint as dcp
m = model()
dcp.load({"model": m.state_dict()}, checkpoint_id="plain-dcp")
for k, v in ref["model"].items():
    same(m.state_dict()[k], v, k)
""",
    )


def test_torch_export_is_one_torch_save_file(saved) -> None:
    tmp = saved["tmp"]
    out = _export(saved["ckpt"], "--to", "torch", "--out", str(tmp / "all.pt"))
    assert out.returncode == 0, out.stderr
    assert "exported step 3" in out.stdout
    _stock(
        tmp,
        _MODEL
        + """
full = torch.load("all.pt", weights_only=False)
assert sorted(full) == ["_steadytrain", "model", "optim"], sorted(full)
for k, v in ref["model"].items():
    same(full["model"][k], v, k)
m = model()
m.load_state_dict(full["model"])
""",
    )


def test_safetensors_export_has_the_model_keys(saved) -> None:
    tmp = saved["tmp"]
    out = _export(saved["root"], "--to", "safetensors", "--out", str(tmp / "st"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tensors"] == 7
    out = _export(saved["root"], "--to", "safetensors", "--out", str(tmp / "one.safetensors"))
    assert out.returncode == 0, out.stderr
    _stock(
        tmp,
        _MODEL
        + """
from safetensors.torch import load_file
for path in ("st/model.safetensors", "one.safetensors"):
    got = load_file(path)
    assert sorted(got) == sorted(ref["model"]), sorted(got)
    for k, v in ref["model"].items():
        same(got[k], v, k)
""",
    )
    out = _export(saved["root"], "--to", "safetensors", "--state", "optim", "--out", str(tmp / "x"))
    assert out.returncode == 2 and "not a module state" in out.stderr and "model" in out.stderr


def test_every_export_follows_the_umask(saved, tmp_path) -> None:
    """safetensors wrote model.safetensors 0600 whatever the umask; the other exports' files
    are 0666 less the umask, and so is it now (a directory and a file DEST)."""
    for to, name in [("dcp", "d"), ("torch", "all.pt"), ("safetensors", "st"),
                     ("safetensors", "one.safetensors")]:  # fmt: skip
        out = forkserver.run(
            [CLI, "export", saved["root"], "--to", to, "--out", str(tmp_path / name)],
            timeout=300, umask=0o027,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    files = ["d/.metadata", "d/__0_0.distcp", "all.pt", "st/model.safetensors", "one.safetensors"]
    modes = {f: oct(os.stat(tmp_path / f).st_mode & 0o777) for f in files}
    assert set(modes.values()) == {"0o640"}, modes


def test_hf_model_from_pretrained(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)  # random init, no hub
    ckpt = Checkpointer(str(tmp_path / "ckpts"))
    ckpt.save(5, {"model": model})
    ckpt.close()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "ref.pt")
    out = _export(str(tmp_path / "ckpts"), "--to", "safetensors", "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    config.save_pretrained(tmp_path / "hf")
    _stock(
        tmp_path,
        """
from transformers import LlamaForCausalLM
ref = torch.load("ref.pt")
m = LlamaForCausalLM.from_pretrained("hf")
sd = m.state_dict()
assert sorted(sd) == sorted(ref), set(sd) ^ set(ref)
for k, v in ref.items():
    assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
""",
    )


def test_safetensors_missing_names_the_extra(saved, tmp_path) -> None:
    """Without the package, the command names the extra to install, before any work."""
    code = (
        "import sys; sys.modules['safetensors'] = None  # as if not installed\n"
        "from steadytrain.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = ["export", saved["root"], "--to", "safetensors", "--out", str(tmp_path / "st")]
    out = forkserver.run([sys.executable, "-c", code, *argv])
    assert out.returncode == 2, out.stderr
    assert "pip install 'steadytrain[export]'" in out.stderr
    assert os.listdir(tmp_path) == []


def _flip_byte(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


def test_bad_input_is_refused_and_writes_nothing(saved, tmp_path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved["root"], bad)
    shard = str(bad / "step-00000003" / "__0_0.distcp")
    _flip_byte(shard)
    for ckpt in (str(bad), str(bad / "step-00000003")):
        out = _export(ckpt, "--to", "dcp", "--out", str(tmp_path / "dest"))
        assert out.returncode == 2, out.stderr
        assert shard in out.stderr and "does not verify" in out.stderr
        assert "Traceback" not in out.stderr
    # an existing destination is never touched
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    out = _export(saved["root"], "--to", "dcp", "--out", str(tmp_path / "taken"))
    assert out.returncode == 2 and "already exists" in out.stderr and "--out" in out.stderr
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]
    # a directory that holds no checkpoint
    (tmp_path / "empty").mkdir()
    out = _export(str(tmp_path / "empty"), "--to", "torch", "--out", str(tmp_path / "x.pt"))
    assert out.returncode == 2 and str(tmp_path / "empty") in out.stderr
    assert "not a checkpoint" in out.stderr or "neither a checkpoint" in out.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad", "empty", "taken"], "export wrote something"


def test_root_skips_a_damaged_newest_checkpoint(tmp_path) -> None:
    root = str(tmp_path / "ckpts")
    _train_and_save(root, steps=(2, 4))
    _flip_byte(os.path.join(root, "step-00000004", "__0_0.distcp"))
    out = _export(root, "--to", "dcp", "--out", str(tmp_path / "d"), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["step"] == 2 and result["source"].endswith("step-00000002")
    assert result["skipped"] and result["skipped"][0]["path"].endswith("step-00000004")
    assert "skipped" in out.stderr and "step-00000004" in out.stderr
