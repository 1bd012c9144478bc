"""Hostile checkpoint directories (issue 25, the checkpoint rows): a pickle that runs code, a
FIFO where a file should be, a flipped bit, a lease file named ``².json``, a resealed
``.metadata`` with an offset past the end of its shard. Each gets a clear error naming the
file, never a hang, never a traceback, never a run that cannot start.

Directories are real checkpoints written by ``Checkpointer`` and then damaged the way an
attacker (or a bad disk) would, resealing COMMIT where that is what it takes to get past it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import os
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint import lease as L
from steadytrain.checkpoint.commit import seal
from steadytrain.errors import CheckpointError
from steadytrain.storage.publish import digest_bytes
from steadytrain.testing import forkserver
from steadytrain.train.torch_save import SUM_SUFFIX, TorchSaveCheckpointer

sys.path.insert(0, os.path.dirname(__file__))

from test_checkpoint_commit import _restore, _save_steps, _states  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
CLI = str(REPO / ".venv" / "bin" / "steadytrain")
TIMEOUT_S = 120  # far beyond a listing of two tiny checkpoints: only a hang reaches it


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = [CLI] if os.path.exists(CLI) else [sys.executable, "-m", "steadytrain.cli"]
    return forkserver.run([*exe, *args], timeout=TIMEOUT_S, cwd=str(REPO))


def _reseal(d: pathlib.Path, sizes: dict[str, bytes | None]) -> None:
    """Rewrite COMMIT so that it lists ``name`` with the size and checksum of ``data`` (what
    anyone who can write the directory can do: a checksum is not a signature)."""
    doc = json.loads((d / "COMMIT").read_text())
    for f in doc["files"]:
        if f["path"] in sizes:
            data = sizes[f["path"]] or b""
            f["size"], f["xxh3_64"] = len(data), digest_bytes(data)
    per_rank = [0] * doc["world"]["world_size"]
    for f in doc["files"]:
        per_rank[f["rank"]] += f["size"]
    doc["world"]["bytes_per_rank"], doc["total_bytes"] = per_rank, sum(per_rank)
    (d / "COMMIT").write_text(json.dumps(seal(doc), indent=1))


# -- row 1: torch_save and a pickle that calls os.system ----------------------------------


class _Payload:
    """Pickles as a call of ``os.system``: what a hostile ``ckpt.pt`` holds."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _reference_states(value: float) -> dict:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.5)
    return {"model": model, "optim": optim, "sched": sched}


@pytest.mark.parametrize("with_checksum", [False, True])
def test_a_torch_save_pickle_that_runs_code_is_refused_and_never_runs(tmp_path, with_checksum):
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt.pt"
    torch.save({"step": 5, "states": {}, "x": _Payload(marker)}, str(path))
    if with_checksum:  # the attacker can write a matching checksum file too
        data = path.read_bytes()
        doc = {"format": "steadytrain-torch-save-checksum", "version": 1}
        doc["accept"] = [{"size": len(data), "xxh3_64": digest_bytes(data)}]
        (tmp_path / f"ckpt.pt{SUM_SUFFIX}").write_text(json.dumps(doc))
    ckpt = TorchSaveCheckpointer(str(tmp_path), every_steps=1)
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as err:
        ckpt.restore_latest(_reference_states(0.0))
    assert "weights-only" in str(err.value)
    assert not marker.exists(), "the pickle's payload ran"


def test_a_real_torch_save_checkpoint_loads_weights_only_and_is_checksummed(tmp_path):
    saved = _reference_states(3.0)
    ckpt = TorchSaveCheckpointer(str(tmp_path), every_steps=1)
    ckpt.save(7, saved)
    ckpt.save(8, saved)  # the second save keeps only its own digest
    doc = json.loads((tmp_path / f"ckpt.pt{SUM_SUFFIX}").read_text())
    data = (tmp_path / "ckpt.pt").read_bytes()
    assert doc["accept"] == [{"size": len(data), "xxh3_64": digest_bytes(data)}]
    states = _reference_states(-1.0)
    assert TorchSaveCheckpointer(str(tmp_path), every_steps=1).restore_latest(states) == 8
    assert torch.equal(states["model"][0].weight, saved["model"][0].weight)
    assert states["optim"].state_dict()["state"][0]["step"] == 1
    # One flipped bit: refused, naming the file, before anything is unpickled.
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0x10
    (tmp_path / "ckpt.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"ckpt\.pt: .* does not list"):
        TorchSaveCheckpointer(str(tmp_path), every_steps=1).restore_latest(states)


def test_a_crash_between_checksum_and_rename_still_verifies(tmp_path):
    """The checksum file is published before ``ckpt.pt`` is renamed into place, listing the
    old digest too: a crash between the two leaves a pair that verifies."""
    ckpt = TorchSaveCheckpointer(str(tmp_path), every_steps=1)
    first = _reference_states(1.0)
    ckpt.save(1, first)
    old = (tmp_path / "ckpt.pt").read_bytes()
    ckpt.save(2, _reference_states(2.0))
    sums = json.loads((tmp_path / f"ckpt.pt{SUM_SUFFIX}").read_text())
    entry = {"size": len(old), "xxh3_64": digest_bytes(old)}
    sums["accept"].append(entry)  # what the file says between the two publishes
    (tmp_path / f"ckpt.pt{SUM_SUFFIX}").write_text(json.dumps(sums))
    (tmp_path / "ckpt.pt").write_bytes(old)  # ... and the rename never happened
    states = _reference_states(-1.0)
    assert TorchSaveCheckpointer(str(tmp_path), every_steps=1).restore_latest(states) == 1
    assert torch.equal(states["model"][0].weight, first["model"][0].weight)


def test_train_with_the_torch_save_engine_resumes_weights_only_and_refuses_a_hostile_file(
    tmp_path,
):
    """The reference loop's real states (GPT, AdamW, LambdaLR, TokenLoader, train state)
    round-trip through ``weights_only=True``; a hostile ``ckpt.pt`` stops ``train`` with exit 2
    naming the file, and its payload never runs."""
    sys.path.insert(0, str(REPO / "tests" / "e2e" / "train"))
    from harness import BASE_SETTINGS, make_dataset

    data = make_dataset(str(tmp_path / "ds"), max_bytes=40_000)
    run = tmp_path / "run"

    def train(steps: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "steadytrain.cli", "train", "demo"]
        for setting in [
            *BASE_SETTINGS,
            f"run_dir={run}",
            f"data.dataset={data}",
            f"train.max_steps={steps}",
            "checkpoint.every_steps=2",
            "checkpoint.engine=torch_save",
        ]:
            cmd += ["--set", setting]
        env = dict(os.environ, STEADYTRAIN_FAULTS="", OMP_NUM_THREADS="1")
        return forkserver.run(cmd, env=env, timeout=300)

    assert train(4).returncode == 0
    second = train(6)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stderr
    ckpt = run / "checkpoints" / "ckpt.pt"
    marker = tmp_path / "pwned"
    torch.save({"step": 6, "states": {}, "x": _Payload(marker)}, str(ckpt))
    (run / "checkpoints" / f"ckpt.pt{SUM_SUFFIX}").unlink()  # an older run's layout
    third = train(8)
    assert third.returncode == 2, third.stderr[-2000:]
    assert str(ckpt) in third.stderr and "weights-only" in third.stderr
    assert "Traceback" not in third.stderr
    assert not marker.exists(), "the pickle's payload ran"


def test_every_torch_load_in_src_is_weights_only():
    """A static check of the code (not the docstrings): every ``torch.load(...)`` call passes
    the literal ``weights_only=True``."""
    calls = []
    for py in (REPO / "src" / "steadytrain").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and ast.unparse(func) == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                safe = isinstance(kw.get("weights_only"), ast.Constant) and (
                    kw["weights_only"].value is True
                )
                calls.append((f"{py.name}:{node.lineno}", safe))
    assert len(calls) >= 2, "torch_save.py and archive.py both load: the scan is broken"
    assert all(safe for _, safe in calls), calls


# -- row 2: a FIFO in place of a file COMMIT lists -------------------------------------


def _fifo_dir(tmp_path: pathlib.Path, what: str) -> tuple[pathlib.Path, str]:
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    if what == "COMMIT":
        (d / "COMMIT").unlink()
        os.mkfifo(d / "COMMIT")
        return d, "COMMIT"
    name = next(p.name for p in d.glob("__0_*.distcp")) if what == "shard" else what
    (d / name).unlink()
    os.mkfifo(d / name)
    _reseal(d, {name: None})  # COMMIT lists it as empty: the size check alone passes
    return d, name


@pytest.mark.parametrize("what", ["shard", "state-rank00000.json", ".metadata", "COMMIT"])
def test_checkpoints_over_a_fifo_finishes_names_it_and_exits_2(tmp_path, what):
    d, name = _fifo_dir(tmp_path, what)
    out = _cli("checkpoints", str(tmp_path), "--json")  # TimeoutExpired here is the bug
    assert out.returncode == 2, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["checkpoints"]}
    assert rows["step-00000001"]["verifies"]
    bad = rows["step-00000002"]
    assert not bad["verifies"] and str(d / name) in bad["error"]
    assert "FIFO" in bad["error"] and "step-00000002" in out.stderr


@pytest.mark.parametrize("what", ["shard", "state-rank00000.json", ".metadata", "COMMIT"])
def test_a_resume_over_a_fifo_skips_it_instead_of_hanging(tmp_path, what):
    d, name = _fifo_dir(tmp_path, what)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint_commit import _restore
        step, _, event = _restore({str(tmp_path)!r})
        print(json.dumps({{"step": step, "skipped": event["skipped"]}}))
        """
    )
    out = forkserver.run([sys.executable, "-c", script], timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 1  # _restore checks the weights are exactly step 1's
    assert [s["step"] for s in result["skipped"]] == [2]
    assert str(d / name) in result["skipped"][0]["reason"]


def test_a_link_to_a_device_is_refused_as_outside_the_directory(tmp_path):
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    (d / "state-rank00000.json").unlink()
    (d / "state-rank00000.json").symlink_to("/dev/zero")
    step, _, event = _restore(tmp_path)
    assert step == 1 and "outside the checkpoint directory" in event["skipped"][0]["reason"]


def test_a_step_directory_linking_out_of_the_root_is_listed_not_read_and_not_deleted(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _save_steps(elsewhere, [1])
    root = tmp_path / "root"
    _save_steps(root, [5])
    (root / "step-00000003").symlink_to(elsewhere / "step-00000001")
    out = _cli("checkpoints", str(root), "--json")
    assert out.returncode == 2, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["checkpoints"]}
    assert "outside the checkpoint root" in rows["step-00000003"]["error"]
    _save_steps(root, [6, 7, 8], keep_last=2)  # retention runs: it must not reach through
    assert (elsewhere / "step-00000001" / "COMMIT").exists()
    assert _restore(root)[0] == 8


# -- row 3: one flipped bit in the newest shard: exit status 2 ---------------------------


def test_checkpoints_exits_2_when_a_committed_checkpoint_does_not_verify(tmp_path):
    _save_steps(tmp_path, [1, 2])
    shard = next((tmp_path / "step-00000002").glob("__0_*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    for args in (["--json"], []):
        out = _cli("checkpoints", str(tmp_path), *args)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "1 committed checkpoint(s)" in out.stderr and "step-00000002" in out.stderr
        assert "do not verify" in out.stderr
    assert "verifies: no" not in out.stdout and "no: " in out.stdout and "checksum" in out.stdout
    # --help says so too (its promise is what scripts rely on).
    helped = _cli("checkpoints", "--help")
    assert "does not verify" in " ".join(helped.stdout.split())
    # Intact again: exit 0.
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert _cli("checkpoints", str(tmp_path)).returncode == 0


# -- row 4: a lease file named ².json (and other names and records that are not leases) ----


@pytest.fixture(autouse=True)
def _no_job_env(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


BAD_NAMES = {
    "².json": "{}",  # '²'.isdigit() is True, int('²') raises
    "٣٣٣٣٣٣٣٣.json": "{}",  # Arabic-Indic digits: isdigit() too
    "1.json": "{}",  # digits, but not the 8-digit name: read back as 00000001.json, missing
    "000000001.json": "{}",  # a 9-digit spelling of generation 1
    "00000002.txt": "{}",
}


def test_malformed_lease_names_are_skipped_and_reported_and_saves_go_on(tmp_path, caplog):
    lease_dir = tmp_path / L.LEASE_DIR
    lease_dir.mkdir(parents=True)
    for name, body in BAD_NAMES.items():
        (lease_dir / name).write_text(body)
    with caplog.at_level(logging.WARNING, logger="steadytrain.checkpoint"):
        events = _save_steps(tmp_path, [1, 2])
    assert [e["ok"] for e in events] == [True, True], [e["error"] for e in events]
    for name in BAD_NAMES:
        assert f"{L.LEASE_DIR}/{name}: not a writer lease name" in caplog.text
        assert (lease_dir / name).exists(), "a file we did not write is never deleted"
    assert _restore(tmp_path)[0] == 2


LEASE_RECORDS = {
    "not_json": b"\xff\xfe not json",
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "list": b"[1, 2]",
    "heartbeat_string": None,  # filled in below from a real record
    "timeout_inf": None,
    "pid_string": None,
    "released_string": None,
    "version_string": None,
    "oversized": b" " * (2 << 20) + b"{}",
}


def _lease_record(case: str) -> bytes:
    if LEASE_RECORDS[case] is not None:
        return LEASE_RECORDS[case]
    rec = {
        "format": L.FORMAT,
        "version": L.VERSION,
        "host": "elsewhere",
        "boot_id": "",
        "pid_ns": "",
        "pid": 4242,
        "pid_start": None,
        "job": "someone",
        "timeout_s": 300.0,
        "heartbeat": 1e12,
        "released": False,
        "token": "t",
    }
    field, value = {
        "heartbeat_string": ("heartbeat", "abc"),
        "timeout_inf": ("timeout_s", float("inf")),
        "pid_string": ("pid", "x"),
        "released_string": ("released", "no"),
        "version_string": ("version", "1"),
    }[case]
    rec[field] = value
    return json.dumps(rec).encode()


@pytest.mark.parametrize("case", sorted(LEASE_RECORDS) + ["fifo", "directory"])
def test_a_malformed_lease_record_is_reported_and_replaced_never_fatal(tmp_path, case, caplog):
    lease_dir = tmp_path / L.LEASE_DIR
    lease_dir.mkdir(parents=True)
    target = lease_dir / "00000004.json"
    if case == "fifo":
        os.mkfifo(target)
    elif case == "directory":
        target.mkdir()
    else:
        target.write_bytes(_lease_record(case))
    with caplog.at_level(logging.WARNING, logger="steadytrain.checkpoint"):
        events = _save_steps(tmp_path, [1])
    assert events[0]["ok"], events[0]["error"]
    assert "00000004.json" in caplog.text
    newest = sorted(p.name for p in lease_dir.glob("*.json") if p.is_file())[-1]
    assert newest == "00000005.json", "the next generation took over"
    assert json.loads((lease_dir / newest).read_text())["took_over"].startswith("it was not")


def test_a_lease_from_a_newer_steadytrain_is_refused_with_the_fix(tmp_path):
    lease_dir = tmp_path / L.LEASE_DIR
    lease_dir.mkdir(parents=True)
    rec = json.loads(_lease_record("pid_string"))
    rec.update(pid=1, version=L.VERSION + 1)
    (lease_dir / "00000001.json").write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match=r"00000001\.json: .*upgrade steadytrain"):
        _save_steps(tmp_path, [1])
    assert not list(tmp_path.glob("step-*")), "nothing written into a root it may not hold"


# -- row 5: a resealed .metadata with a bad offset ----------------------------------------


def _bad_offset(d: pathlib.Path) -> tuple[str, int]:
    """Move one record of ``.metadata`` past the end of its shard; reseal COMMIT."""
    meta = pickle.loads((d / ".metadata").read_bytes())
    key, info = next(iter(meta.storage_data.items()))
    size = (d / info.relative_path).stat().st_size
    meta.storage_data[key] = dataclasses.replace(info, offset=size + 1000)
    data = pickle.dumps(meta)
    (d / ".metadata").write_bytes(data)
    _reseal(d, {".metadata": data})
    return info.relative_path, size + 1000


@pytest.mark.parametrize("verify", ["overlap", "full"])
def test_a_metadata_offset_past_the_shard_is_named_not_called_truncated(tmp_path, verify):
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    shard, offset = _bad_offset(d)
    step, _, event = _restore(tmp_path, verify=verify)
    assert step == 1 and [s["step"] for s in event["skipped"]] == [2]
    reason = event["skipped"][0]["reason"]
    assert "(truncated?)" not in reason
    assert str(d / shard) in reason
    assert f".metadata places a record at offset {offset}" in reason
    assert "outside this file's" in reason


def test_a_short_shard_is_still_called_truncated(tmp_path):
    """The message kept for the case it was written for: a file shorter than COMMIT says."""
    _save_steps(tmp_path, [1, 2])
    shard = next((tmp_path / "step-00000002").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-5])
    step, _, event = _restore(tmp_path, verify="overlap")
    assert step == 1 and "shorter (truncated?)" in event["skipped"][0]["reason"]


# -- loader and RNG state inside a checkpoint ---------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["rng"].update(torch="AAAA"),
        lambda doc: doc["rng"]["numpy"].update(key=[-1] * 624),
        lambda doc: doc["rng"].update(python=[3, "x", None]),
        lambda doc: doc.update(states=[]),
    ],
)
def test_a_malformed_rank_state_is_skipped_before_any_tensor_is_loaded(tmp_path, edit):
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    doc = json.loads((d / "state-rank00000.json").read_text())
    edit(doc)
    data = json.dumps(doc).encode()
    (d / "state-rank00000.json").write_bytes(data)
    _reseal(d, {"state-rank00000.json": data})
    states = _states(-1)
    events: list[dict] = []
    ckpt = Checkpointer(str(tmp_path), async_mode="sync", on_event=events.append)
    assert ckpt.restore_latest(states) == 1
    assert torch.all(states["model"].weight == 1.0) and states["loader"].cursor == 1
    assert "state-rank00000.json" in events[-1]["skipped"][0]["reason"]


def test_a_deeply_nested_rank_state_is_passed_over_by_restore_and_export_alike(tmp_path):
    """A state file of 100k nested brackets (resealed, so it verifies): restore passes the
    checkpoint over for the older one; export did so with a RecursionError traceback. Both
    read it with one parser now: export of the root takes the older checkpoint too, saying
    why, and export of that checkpoint itself is refused naming the file."""
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    data = b"[" * 100_000 + b"]" * 100_000
    (d / "state-rank00000.json").write_bytes(data)
    _reseal(d, {"state-rank00000.json": data})
    step, _, event = _restore(tmp_path)
    assert step == 1 and "state-rank00000.json" in event["skipped"][0]["reason"]
    named = f"{d}/state-rank00000.json: nests too deeply"
    out = _cli("export", str(tmp_path), "--to", "dcp", "--out", str(tmp_path / "x"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] == 1 and named in out.stderr
    for to in ("dcp", "torch", "safetensors"):
        out = _cli("export", str(d), "--to", to, "--out", str(tmp_path / f"y-{to}"))
        assert out.returncode == 2 and named in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith("step-")) == [
        ".writer-lease",
        "x",
    ]  # nothing written for the refused exports, not even a temporary


# -- a restore's download directory (.restore-*) is never followed -------------------------


def test_the_download_directory_is_made_never_followed_and_never_another_users(tmp_path):
    """``own_dir``: a symlink where the download goes is removed as a link and a directory
    of this user made (0700); another user's directory there, or a file, is refused
    naming it and left as it is. ``sweep`` and ``release`` remove links as links."""
    from steadytrain.checkpoint import download as D
    from steadytrain.checkpoint.remote import Root

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("mine")
    where = tmp_path / ".restore-step-00000002-rank0-1"
    where.symlink_to(victim)
    D.own_dir(str(where))
    assert where.is_dir() and not where.is_symlink()
    assert where.stat().st_mode & 0o777 == 0o700 and where.stat().st_uid == os.geteuid()
    assert os.listdir(victim) == ["precious"]
    D.own_dir(str(where))  # a mate joins the directory another mate made
    other = tmp_path / ".restore-step-00000002-rank4-1"
    other.mkdir()
    os.chown(other, 65534, 65534)  # the tests run as root: another uid's directory
    with pytest.raises(CheckpointError, match=rf"{other}: a directory of uid 65534") as err:
        D.own_dir(str(other))
    assert "chmod 700" in str(err.value) and other.stat().st_uid == 65534
    afile = tmp_path / ".restore-step-00000002-rank8-1"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match="a regular file, not a directory"):
        D.own_dir(str(afile))
    # left by a dead process of this rank: a link is unlinked, its target left whole
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f".restore-step-00000001-rank0-{dead.pid}"
    left.symlink_to(victim)
    D.sweep(Root(str(tmp_path)), 0)
    assert not os.path.lexists(left) and os.listdir(victim) == ["precious"]
    assert other.is_dir()  # another rank's name, another user's: not this rank's to sweep
