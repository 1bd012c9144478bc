"""Depend like a library: the core install works alone, and installing leaves torch alone.

The package is installed the way a user installs it: from a **built wheel**, not from the
source tree. The module fixture copies what the build reads (``pyproject.toml``,
``README.md``, ``src/``) to a scratch directory, builds the wheel there with the README's
command (``pip wheel --no-deps``, build isolation on: setuptools comes from the index like
on a user's machine), and installs that wheel into one fresh virtual environment with the
core dependencies only, at the locked versions (``constraints.txt``; torch comes from the
CPU wheel the lock names). CI (``.ci/run`` -> ``./run.sh test``) runs this file, so CI
builds the wheel. In that environment:

* the installed package is the wheel's (site-packages, a ``direct_url.json`` naming the
  ``.whl``), with its package data (``configs/*.toml``) and its console script;
* ``import steadytrain``, a dataset, ``TokenLoader`` and a ``Checkpointer`` save/restore
  work with no extra installed;
* each optional part names the extra to install instead of a bare ``ModuleNotFoundError``;
* ``pip install --dry-run --report`` of the wheel's ``[all]`` next to the installed torch
  plans no torch install (the declared range accepts what the user has), and the line a
  missing extra prints (``pip install 'steadytrain[report]'``) resolves against the
  installed wheel although no index has steadytrain.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]


def _pip(venv: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(venv, "bin", "python"), "-m", "pip", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel, built from a clean copy of the sources (no ``build/`` or ``*.egg-info``
    left over in the checkout can leak into it, and concurrent runs do not share them)."""
    scratch = tmp_path_factory.mktemp("wheel")
    src = scratch / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(REPO, name), src / name)
    shutil.copytree(
        os.path.join(REPO, "src"),
        src / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    dist = scratch / "dist"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (built,) = glob.glob(str(dist / "steadytrain-*.whl"))
    return built


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory, wheel):
    venv = str(tmp_path_factory.mktemp("core") / "venv")
    # ensurepip alone took over 120 s at load ~25 (CI: 4 workers on 2 cores): a generous limit
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=600)
    # The built wheel, no extras, exact versions from the lock: what the README's wheel
    # install gives a user, minus the network lottery.
    # --no-compile: pip would byte-compile every installed .py, torch's and numpy's 2,800
    # files among them (~12 s of CPU measured here, compileall of the same files), for
    # .pyc files a handful of imports below would write anyway. Nothing here is about them.
    constraints = os.path.join(REPO, "constraints.txt")
    res = _pip(venv, "install", "-q", "--no-compile", "-c", constraints, wheel)
    assert res.returncode == 0, res.stderr[-3000:]
    yield venv
    shutil.rmtree(os.path.dirname(venv), ignore_errors=True)  # ~1 GB: do not leave it


def test_wheel_holds_the_package_and_its_data(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"steadytrain/configs/demo.toml", "steadytrain/configs/small.toml"} <= names
    assert "steadytrain/cli.py" in names and "steadytrain/__init__.py" in names
    assert not any(n.startswith(("tests/", "bench/", "src/")) for n in names), sorted(names)[:20]
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as z:
        assert "steadytrain = steadytrain.cli:main" in z.read(entry).decode()


def test_installed_package_is_the_wheel(core_venv, wheel, tmp_path):
    res = _run(
        core_venv,
        """
        import importlib.metadata, importlib.resources, json, sys, sysconfig
        import steadytrain
        dist = importlib.metadata.distribution("steadytrain")
        print(json.dumps({
            "file": steadytrain.__file__,
            "purelib": sysconfig.get_paths()["purelib"],
            "direct_url": json.loads(dist.read_text("direct_url.json") or "{}"),
            "demo_toml": (importlib.resources.files("steadytrain") / "configs" / "demo.toml")
                         .is_file(),
        }))
        """,
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(got["purelib"]), got  # not the checkout, not editable
    assert got["direct_url"]["url"].endswith(os.path.basename(wheel)), got["direct_url"]
    assert "archive_info" in got["direct_url"], got["direct_url"]  # a file, not a source dir
    assert got["demo_toml"]  # package data made it through the wheel
    # The console script the wheel declares, over the installed package.
    cli = os.path.join(core_venv, "bin", "steadytrain")
    res = subprocess.run([cli, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "checkpoints" in res.stdout, res.stderr[-2000:]


def _run(venv: str, code: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(venv, "bin", "python"), "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )


def test_core_only_loader_and_checkpoint_round_trip(core_venv, tmp_path):
    res = _run(
        core_venv,
        """
        import importlib.util, json
        import numpy as np, torch
        import steadytrain
        from steadytrain import Checkpointer, TokenDataset, TokenLoader
        from steadytrain.data.ingest.writer import DatasetWriter

        absent = [m for m in ("s3fs", "mlflow", "matplotlib", "pyarrow")
                  if importlib.util.find_spec(m) is not None]
        assert not absent, f"core install pulled optional packages: {absent}"
        rng = np.random.default_rng(0)
        with DatasetWriter("ds", vocab_size=257, eos_id=256,
                           tokenizer={"type": "bytes"}, shard_tokens=4096) as w:
            for _ in range(40):
                doc = rng.integers(0, 256, 200)
                w.add_document(np.append(doc, 256))
        ds = TokenDataset.open("ds")
        loader = TokenLoader(ds, seq_len=32, global_batch=8, micro_batch=4, seed=1)
        it = iter(loader)
        first = [next(it)["sample_ids"].tolist() for _ in range(3)]
        model = torch.nn.Linear(4, 4)
        ckpt = Checkpointer("ckpts", every_steps=1, keep_last=2, async_mode="sync")
        ckpt.save(3, {"model": model, "loader": loader})
        ckpt.close()
        want = [next(it)["sample_ids"].tolist() for _ in range(2)]
        loader.close()
        fresh_model = torch.nn.Linear(4, 4)
        fresh = TokenLoader(ds, seq_len=32, global_batch=8, micro_batch=4, seed=1)
        ckpt2 = Checkpointer("ckpts", every_steps=1, keep_last=2, async_mode="sync")
        step = ckpt2.restore_latest({"model": fresh_model, "loader": fresh})
        it2 = iter(fresh)
        got = [next(it2)["sample_ids"].tolist() for _ in range(2)]
        assert step == 3, step
        assert torch.equal(model.weight, fresh_model.weight)
        print(json.dumps({"first": first, "want": want, "got": got}))
        """,
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"]  # the restored loader continues where it stood


@pytest.mark.parametrize(
    "code, extra",
    [
        (
            "from steadytrain.storage.store import Store; Store('s3://bucket/x')",
            "steadytrain[s3]",
        ),
        (
            "from steadytrain.monitor.mlflow_sink import MlflowSink; MlflowSink('.')",
            "steadytrain[mlflow]",
        ),
        (
            "from steadytrain.report.build import _plots; _plots({}, None)",
            "steadytrain[report]",
        ),
    ],
)
def test_missing_extra_names_the_install_line(core_venv, tmp_path, code, extra):
    res = _run(core_venv, f"from steadytrain.errors import ConfigError\n{code}", str(tmp_path))
    assert res.returncode != 0
    assert f"pip install '{extra}'" in res.stderr, res.stderr[-2000:]
    assert "ModuleNotFoundError" not in res.stderr.splitlines()[-1]


def test_parquet_input_without_pyarrow_names_the_extra(core_venv, tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
    cli = os.path.join(core_venv, "bin", "steadytrain")
    res = subprocess.run(
        [cli, "tokenize", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "ds"),
         "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert "pip install 'steadytrain[parquet]'" in res.stderr
    assert "Traceback" not in res.stderr


def test_install_next_to_an_installed_torch_leaves_it_alone(core_venv, wheel, tmp_path):
    """A user's torch (here the one already in the venv) satisfies the declared range, so
    resolving the wheel's ``[all]`` without the lock plans no torch download."""
    report = tmp_path / "report.json"
    res = _pip(
        core_venv, "install", "--dry-run", "--quiet", "--report", str(report), f"{wheel}[all]"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    planned = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "torch" not in planned, sorted(planned)
    assert {"s3fs", "matplotlib", "mlflow-skinny"} <= planned  # the extras do resolve


def test_missing_extra_line_resolves_against_the_installed_wheel(core_venv, tmp_path):
    """``pip install 'steadytrain[report]'``, the line a missing extra prints, works for a
    user who installed the wheel: pip takes the installed steadytrain (no index has it) and
    plans only the extra's packages."""
    report = tmp_path / "report.json"
    res = _pip(
        core_venv, "install", "--dry-run", "--quiet", "--report", str(report),
        "steadytrain[report]",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    planned = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "matplotlib" in planned and not {"steadytrain", "torch"} & planned, sorted(planned)
