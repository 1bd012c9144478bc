"""Two-phase commit, verification, damaged checkpoints and COMMITs, retention and the in-flight
policy.

Single process (DCP without a process group); the multi-rank paths are in tests/distributed/.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.commit import parse_commit, safe_name, seal
from steadytrain.cli import main as cli_main
from steadytrain.errors import CheckpointError, ConfigError


class Cursor:
    def __init__(self) -> None:
        self.cursor = 0

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, sd: dict) -> None:
        self.cursor = sd["cursor"]


def _states(step: int = 0) -> dict:
    model = nn.Linear(8, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    loader = Cursor()
    loader.cursor = step
    return {"model": model, "loader": loader}


def _save_steps(directory, steps, **kw) -> list[dict]:
    events: list[dict] = []
    ckpt = Checkpointer(
        str(directory), every_steps=1, async_mode="sync", on_event=events.append, **kw
    )
    for s in steps:
        ckpt.maybe_save(s, _states(s), tokens_seen=10 * s)
    ckpt.close()
    return events


def _restore(directory, **kw) -> tuple[int, dict, dict]:
    events: list[dict] = []
    states = _states(-1)
    ckpt = Checkpointer(str(directory), async_mode="sync", on_event=events.append, **kw)
    step = ckpt.restore_latest(states)
    if step:
        assert states["loader"].cursor == step
        assert torch.all(states["model"].weight == float(step))
    return step, states, events[-1]


def test_commit_manifest_is_written_last_and_complete(tmp_path):
    _save_steps(tmp_path, [5])
    d = tmp_path / "step-00000005"
    doc = json.loads((d / "COMMIT").read_text())
    assert doc["format"] == "steadytrain-checkpoint" and doc["format_version"] == 3
    assert doc["world"]["tensor_format"] == "raw"
    assert doc["commit_checksum"].startswith("xxh3_128:")
    assert doc["step"] == 5 and doc["tokens_seen"] == 50
    assert doc["world"]["world_size"] == 1
    listed = {f["path"] for f in doc["files"]}
    assert listed == {p.name for p in d.iterdir()} - {"COMMIT"}
    assert all(len(f["xxh3_64"]) == 16 and f["size"] > 0 for f in doc["files"])
    assert doc["total_bytes"] == sum(f["size"] for f in doc["files"])


def test_restore_empty_dir_returns_zero(tmp_path):
    step, _, event = _restore(tmp_path)
    assert step == 0 and event["type"] == "restore" and event["skipped"] == []


@pytest.mark.parametrize("damage", ["missing_metadata", "truncated", "bitflip", "bad_commit"])
def test_damaged_newest_falls_back_to_older(tmp_path, damage):
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    shard = next(d.glob("__0_*.distcp"))
    if damage == "missing_metadata":
        (d / ".metadata").unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif damage == "bitflip":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        shard.write_bytes(bytes(raw))
    else:
        (d / "COMMIT").write_bytes(b'{"format": "steadytrain-checkpoint", "step": ')
    step, _, event = _restore(tmp_path)
    assert step == 1, "must fall back to the older committed checkpoint"
    assert [s["step"] for s in event["skipped"]] == [2]
    reason = event["skipped"][0]["reason"]
    expect = {
        "missing_metadata": "missing",
        "truncated": "truncated",
        "bitflip": "checksum",
        "bad_commit": "not valid JSON",
    }[damage]
    assert expect in reason


def test_partial_directory_is_never_loaded_and_never_reused(tmp_path):
    _save_steps(tmp_path, [3])
    partial = tmp_path / "step-00000004"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    step, _, event = _restore(tmp_path)
    assert step == 3 and event["skipped"][0]["step"] == 4
    events = _save_steps(tmp_path, [4])
    assert events[0]["path"].endswith("step-00000004.1"), "a directory is never reused"
    assert (tmp_path / "step-00000004.1" / "COMMIT").exists()
    assert not partial.exists(), "retention removes the abandoned partial once 4.1 commits"
    assert _restore(tmp_path)[0] == 4


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/abs/file", "a/../../b", "x\\y", ""])
def test_commit_paths_escaping_the_directory_are_refused(tmp_path, bad):
    with pytest.raises(CheckpointError):
        safe_name(bad)
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    doc = json.loads((d / "COMMIT").read_text())
    doc["files"].append({"path": bad, "size": 1, "xxh3_64": "0" * 16, "rank": 0})
    (d / "COMMIT").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError):
        parse_commit((d / "COMMIT").read_bytes(), str(d))
    assert _restore(tmp_path)[0] == 1


def test_symlink_out_of_the_directory_is_refused(tmp_path):
    _save_steps(tmp_path / "c", [1, 2])
    d = tmp_path / "c" / "step-00000002"
    shard = next(d.glob("__0_*.distcp"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    step, _, event = _restore(tmp_path / "c")
    assert step == 1 and "outside" in event["skipped"][0]["reason"]


def test_unknown_format_version_is_refused_with_the_fix(tmp_path):
    _save_steps(tmp_path, [1])
    c = tmp_path / "step-00000001" / "COMMIT"
    doc = json.loads(c.read_text())
    doc["format_version"] = 99
    with pytest.raises(CheckpointError, match="upgrade steadytrain"):
        parse_commit(json.dumps(doc).encode(), str(c))


def test_retention_keeps_last_k_and_milestones_and_drops_old_partials(tmp_path):
    (tmp_path / "step-00000002.1").mkdir(parents=True)  # abandoned partial, older
    (tmp_path / "step-00000099").mkdir()  # newer partial: might be in flight, kept
    (tmp_path / "notes.txt").write_text("not ours")
    _save_steps(tmp_path, range(1, 8), keep_last=2, keep_every=3)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        ".writer-lease",  # the writer lease (docs/checkpoint.md): retention never touches it
        "notes.txt",
        "step-00000003",
        "step-00000006",
        "step-00000007",
        "step-00000099",
    ]


def test_retention_keeps_pinned_steps_until_they_are_unpinned(tmp_path):
    """A trainer's own choice (ModelCheckpoint's best k) outlives keep_last while pinned;
    unpinned, the next save's retention removes it, but never one of the newest keep_last."""
    ckpt = Checkpointer(str(tmp_path), every_steps=1, async_mode="sync", keep_last=2)
    ckpt.pinned_steps = frozenset({1, 3})
    for s in range(1, 6):
        ckpt.maybe_save(s, _states(s))
    assert _committed_steps(tmp_path) == [1, 3, 4, 5]
    ckpt.pinned_steps = frozenset({3, 6})  # 1 unpinned; 6 pinned as it is saved
    ckpt.maybe_save(6, _states(6))
    assert _committed_steps(tmp_path) == [3, 5, 6]
    ckpt.pinned_steps = frozenset()
    ckpt.maybe_save(7, _states(7))
    ckpt.close()
    assert _committed_steps(tmp_path) == [6, 7]


def _committed_steps(root) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))


def test_in_flight_policy_waits_for_the_previous_save(tmp_path):
    events: list[dict] = []
    ckpt = Checkpointer(str(tmp_path), every_steps=1, async_mode="thread", on_event=events.append)
    states = _states(1)
    ckpt.maybe_save(1, states)
    ckpt.maybe_save(2, states)  # due while step 1 may still be writing: waits for it first
    assert [e["step"] for e in events] == [1], "step 1 must be durable before step 2 stages"
    ckpt.close()
    assert [e["step"] for e in events] == [1, 2] and all(e["ok"] for e in events)


def test_snapshot_is_consistent_with_the_step(tmp_path):
    """Mutating the model right after save() returns must not leak into the checkpoint."""
    ckpt = Checkpointer(str(tmp_path), async_mode="thread")
    states = _states(7)
    ckpt.save(7, states)
    with torch.no_grad():
        states["model"].weight.fill_(1e9)  # the next optimizer step, while the write runs
    ckpt.close()
    assert _restore(tmp_path)[0] == 7  # _restore checks the weights are exactly 7


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="async_mode"):
        Checkpointer(str(tmp_path), async_mode="fast")
    with pytest.raises(ConfigError, match="keep_last"):
        Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(ConfigError, match="remote="):
        Checkpointer("s3://bucket/ckpt")
    with pytest.raises(ConfigError, match="every_seconds"):
        Checkpointer(str(tmp_path), interval="seconds")
    with pytest.raises(ConfigError, match="torch.distributed"):
        Checkpointer(str(tmp_path), async_mode="process")


def test_interval_every_steps_and_every_seconds(tmp_path):
    events = _save_steps(tmp_path / "a", [])
    ckpt = Checkpointer(
        str(tmp_path / "a"), every_steps=3, async_mode="sync", on_event=events.append
    )
    for s in range(1, 10):
        ckpt.maybe_save(s, _states(s))
    assert [e["step"] for e in events] == [3, 6, 9]
    ev2: list[dict] = []
    ck2 = Checkpointer(
        str(tmp_path / "b"), every_seconds=3600, async_mode="sync", on_event=ev2.append
    )
    for s in range(1, 5):
        ck2.maybe_save(s, _states(s))
    assert ev2 == [], "nothing is due within the first hour"
    ck2._last_save_t -= 3601  # an hour passes
    ck2.maybe_save(5, _states(5))
    assert [e["step"] for e in ev2] == [5]


def _flip_shard(d) -> None:
    shard = next(d.glob("__0_*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    shard.write_bytes(bytes(raw))


def test_overlap_verify_falls_back_when_a_shard_fails_after_loading(tmp_path):
    _save_steps(tmp_path, [1, 2])
    _flip_shard(tmp_path / "step-00000002")
    step, _, event = _restore(tmp_path, verify="overlap")  # checks weights == 1 exactly
    assert step == 1 and "checksum" in event["skipped"][0]["reason"]


def test_overlap_verify_with_nothing_older_raises_instead_of_training_on_garbage(tmp_path):
    _save_steps(tmp_path, [1])
    _flip_shard(tmp_path / "step-00000001")
    with pytest.raises(CheckpointError, match="overwrote part of the live state") as err:
        Checkpointer(str(tmp_path), verify="overlap").restore_latest(_states(-1))
    # Removal is suggested only for what failed verification, and names it.
    assert "failed verification and cannot be restored: step-00000001" in str(err.value)
    # The default ("full") verifies before loading: nothing is touched, resume from scratch.
    states = _states(-1)
    assert Checkpointer(str(tmp_path)).restore_latest(states) == 0
    assert torch.all(states["model"].weight == -1.0)


# -- COMMIT validation: refused whole, before anything is read or loaded ------------------


def _edit(doc: dict, case: str) -> bytes:
    """COMMIT bytes for one kind of damage (``seal`` re-checksums: the schema must catch it)."""
    if case == "deep_arrays":
        return b"[" * 100_000 + b"]" * 100_000
    if case == "deep_extra":
        nested: object = 0
        for _ in range(40):
            nested = {"x": nested}
        return json.dumps(seal({**doc, "extra": nested})).encode()
    if case == "nan":
        return json.dumps(seal(doc)).replace('"block_s": ', '"block_s": NaN, "b": ').encode()
    if case == "repeated_key":
        return json.dumps(seal(doc)).replace('"step": 2', '"step": 2, "step": 1').encode()
    if case == "tokens_bitflip":  # one bit of tokens_seen (20 -> 21), checksum left alone
        return json.dumps({**doc, "tokens_seen": doc["tokens_seen"] ^ 1}).encode()
    if case == "version_bitflip":  # '2' -> '1' is one bit too: the checksum covers it
        return json.dumps({**doc, "format_version": 1}).encode()
    if case == "no_checksum":
        return json.dumps({k: v for k, v in doc.items() if k != "commit_checksum"}).encode()
    bad = json.loads(json.dumps(doc))
    if case == "tokens_string":
        bad["tokens_seen"] = "20"
    elif case == "world_string":
        bad["world"] = "1"
    elif case == "world_size_string":
        bad["world"]["world_size"] = "x"
    elif case == "size_string":
        bad["files"][0]["size"] = str(bad["files"][0]["size"])
    elif case == "rank_out_of_range":
        bad["files"][0]["rank"] = 7
    elif case == "total_bytes":
        bad["total_bytes"] += 1
    elif case == "negative_wall_time":
        bad["wall_time"] = -1.0
    return json.dumps(seal(bad)).encode()


MALFORMED = {
    "deep_arrays": "nests too deeply",
    "deep_extra": "nests deeper than 16",
    "nan": "NaN is not a number JSON allows",
    "repeated_key": "'step' appears twice",
    "tokens_bitflip": "commit_checksum",
    "version_bitflip": "commit_checksum",
    "no_checksum": "has no commit_checksum",
    "tokens_string": "tokens_seen='20' is not a non-negative integer",
    "world_string": "world='1' is not an object",
    "world_size_string": "world.world_size='x' is not a positive integer",
    "size_string": "malformed file entry",
    "rank_out_of_range": "malformed file entry",
    "total_bytes": "total_bytes=",
    "negative_wall_time": "wall_time=-1.0 is not a non-negative number",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_commit_is_refused_whole_and_restore_uses_the_older_one(tmp_path, capsys, case):
    _save_steps(tmp_path, [1, 2])
    d = tmp_path / "step-00000002"
    doc = json.loads((d / "COMMIT").read_text())
    raw = _edit(doc, case)
    (d / "COMMIT").write_bytes(raw)
    with pytest.raises(CheckpointError, match=re.escape(MALFORMED[case])) as err:
        parse_commit(raw, str(d))
    assert str(d) in str(err.value), "the error names the checkpoint"
    step, _, event = _restore(tmp_path)  # checks weights and loader are exactly step 1's
    assert step == 1 and event["tokens_seen"] == 10
    assert [s["step"] for s in event["skipped"]] == [2]
    assert MALFORMED[case] in event["skipped"][0]["reason"]
    # The listing marks the row and lists everything: no traceback, then exit status 2.
    assert cli_main(["checkpoints", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    assert "1 damaged checkpoint(s)" in captured.err and "step-00000002" in captured.err
    rows = {r["name"]: r for r in json.loads(captured.out)["checkpoints"]}
    assert rows["step-00000002"]["state"] == "damaged"
    assert not rows["step-00000002"]["verifies"]
    assert MALFORMED[case] in rows["step-00000002"]["error"]
    assert rows["step-00000001"]["verifies"]


def test_malformed_commit_with_nothing_older_leaves_live_state_untouched(tmp_path, capsys):
    _save_steps(tmp_path, [1])
    c = tmp_path / "step-00000001" / "COMMIT"
    c.write_bytes(_edit(json.loads(c.read_text()), "tokens_string"))
    states = _states(-1)
    assert Checkpointer(str(tmp_path), verify="overlap").restore_latest(states) == 0
    assert torch.all(states["model"].weight == -1.0) and states["loader"].cursor == -1
    assert cli_main(["checkpoints", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "damaged" in out and "tokens_seen='20'" in out


def test_oversized_commit_is_refused_before_parsing(tmp_path, monkeypatch):
    from steadytrain.checkpoint import commit

    _save_steps(tmp_path, [1])
    raw = (tmp_path / "step-00000001" / "COMMIT").read_bytes()
    monkeypatch.setattr(commit, "MAX_COMMIT_BYTES", len(raw) - 1)
    with pytest.raises(CheckpointError, match=f"COMMIT is {len(raw)} bytes, more than"):
        parse_commit(raw, "step-00000001")


def test_version_1_commit_still_loads_with_a_warning_and_its_schema_checked(tmp_path, caplog):
    """Checkpoints written before the checksum existed: validated, loaded, warned about."""
    _save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        c = tmp_path / f"step-0000000{step}" / "COMMIT"
        doc = json.loads(c.read_text())
        del doc["commit_checksum"]
        doc["format_version"] = 1
        if step == 2:
            doc["tokens_seen"] = "20"  # version 1 gets every schema check too
        c.write_text(json.dumps(doc, indent=1))
    with caplog.at_level("WARNING", logger="steadytrain.checkpoint"):
        step, _, event = _restore(tmp_path)
    assert step == 1 and "tokens_seen='20'" in event["skipped"][0]["reason"]
    assert "format_version 1 has no commit_checksum" in caplog.text
