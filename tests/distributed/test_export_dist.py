"""``steadytrain export`` of a 2-rank FSDP2 checkpoint (DTensor shards, raw records).

Two real gloo ranks save with the ``Checkpointer`` defaults; the export is read by DCP's
stock ``dcp_to_torch_save`` in a process that never imports steadytrain, and every model
and optimizer tensor equals the full state the ranks held.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from steadytrain.testing import forkserver

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)
from launch import launch  # noqa: E402

WORKER = os.path.join(HERE, "worker.py")
CLI = os.path.join(os.path.dirname(sys.executable), "steadytrain")

pytestmark = pytest.mark.dist

READER = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], "full.pt")
got = torch.load("full.pt", weights_only=False)
ref = torch.load(sys.argv[2], weights_only=False)["full"]
def walk(a, b, where):
    if isinstance(b, dict):
        assert set(a) >= set(b), (where, set(b) - set(a))
        for k in b:
            walk(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{where}[{i}]")
    elif isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)
walk(got["model"], ref["model"], "model")
walk(got["optim"]["state"], ref["optim"]["state"], "optim.state")
assert got["_steadytrain"]["world_size"] == 2 and len(got["_steadytrain"]["ranks"]) == 2
assert got["_steadytrain"]["ranks"][1]["states"]["loader"]["cursor"] == 64
assert "steadytrain" not in sys.modules
print("READ OK")
"""


@pytest.mark.timeout(240)
def test_two_rank_fsdp_checkpoint_exports_for_stock_dcp(tmp_path) -> None:
    ref = str(tmp_path / "ref")
    launch(WORKER, ["save", "fsdp:thread", str(tmp_path), ref], world=2)
    root = str(tmp_path / "fsdp")
    commit = json.loads(open(os.path.join(root, "step-00000004", "COMMIT")).read())
    assert commit["world"]["tensor_format"] == "raw"
    assert {f["rank"] for f in commit["files"]} == {0, 1}
    dest = tmp_path / "plain"
    out = forkserver.run([CLI, "export", root, "--to", "dcp", "--out", str(dest), "--json"],
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] == 4
    assert sorted(n for n in os.listdir(dest) if n.startswith("__")) == [
        "__0_0.distcp", "__1_0.distcp", "__steadytrain.distcp",
    ]  # fmt: skip
    script = tmp_path / "reader.py"
    script.write_text(READER)
    # Forked too: the server never imports steadytrain, so the reader's own check
    # (``"steadytrain" not in sys.modules``) still holds.
    got = forkserver.run([sys.executable, str(script), str(dest), f"{ref}.fsdp.rank0"],
                         timeout=300, cwd=str(tmp_path))  # fmt: skip
    assert got.returncode == 0 and "READ OK" in got.stdout, got.stdout + got.stderr[-3000:]
