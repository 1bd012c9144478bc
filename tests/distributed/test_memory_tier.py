"""The memory tier on real gloo ranks "on several nodes": restore from the newest good point.

Each rank process gets its own ``STEADYTRAIN_NODE`` and the memory directory of its node
(``memory_launch.py``); wiping a node's directory is what losing that node does to its RAM.
A job trains 6 steps (memory snapshot every step, durable checkpoint every 4) and ends as if
killed; each case then restores from a fresh copy of the memory directories, damaged as the
case says, and every rank compares what it got with the reference it wrote at that step:
every model and optimizer tensor, the JSON states and the next draws of every RNG.

(a) all memory intact: local-memory, step 6; (b) one node lost: its ranks fetch from their
peers, step 6 (newer than any durable checkpoint, whose data files are moved away: no durable
read); (c) a node and its peer lost: durable step 4; (d) torn generations (a .tmp file, a
truncated file, a flipped byte) are never loaded: a good copy, the older generation or
durable is; (e) another world size: durable; (f) memory older than the newest durable commit
(the job went on past its snapshots and saved durably; the nodes kept older copies): durable. A
copy damaged on its way to the peer (a byte flipped in transit, injected by the worker) is
never published there. Then SIGKILLs at random moments while the job
snapshots every step: every restart restores bit-exactly some snapshotted step.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import signal
import sys
import time

import pytest

HERE = os.path.join(os.path.dirname(__file__), "checkpoint")
sys.path.insert(0, HERE)
from memory_launch import Job, run  # noqa: E402

WORKER = os.path.join(HERE, "memory_worker.py")
TWO_NODES = ["a", "a", "b", "b"]  # rank 0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1
FOUR_NODES = ["a", "b", "c", "d"]  # a ring: rank r's copy is kept by rank r + 1

pytestmark = pytest.mark.dist


class Trained:
    """A job that trained 6 steps and was killed: its durable dir, references and memory."""

    def __init__(self, base: str, nodes: list[str], parallel: str = "ddp") -> None:
        self.base, self.nodes, self.parallel = base, nodes, parallel
        for d in ("ckpt", "refs", "out", "pristine"):
            os.makedirs(os.path.join(base, d), exist_ok=True)
        mem = self.memdirs(os.path.join(base, "pristine"))
        run(WORKER, self.args("train", "6", "crash"), nodes, mem)
        self.runs = 0

    def memdirs(self, root: str) -> dict[str, str]:
        return {n: os.path.join(root, f"mem-{n}") for n in sorted(set(self.nodes))}

    def args(self, tag: str, until: str, end: str) -> list[str]:
        b = self.base
        return [f"{b}/ckpt", f"{b}/refs", f"{b}/out", tag, until, end, "32", self.parallel]

    def restore(self, damage=None, nodes: list[str] | None = None) -> list[dict]:
        """A fresh copy of every node's memory, ``damage(key dirs by node)``, one restore."""
        self.runs += 1
        work = os.path.join(self.base, f"work{self.runs}")
        mem = self.memdirs(work)
        for node, src in self.memdirs(os.path.join(self.base, "pristine")).items():
            shutil.copytree(src, mem[node])
        if damage is not None:
            damage({n: _key_dir(d) for n, d in mem.items()})
        nodes = nodes or self.nodes
        tag = f"restore{self.runs}"
        run(WORKER, self.args(tag, "0", "crash"), nodes, mem)
        results = [_result(self.base, tag, r) for r in range(len(nodes))]
        for r in results:
            assert r["diff"] == [], f"rank {r['rank']} restored step {r['step']} inexactly: {r}"
        return results


def _key_dir(memdir: str) -> str:
    (key,) = os.listdir(memdir)  # one job: one key directory
    return os.path.join(memdir, key)


def _result(base: str, tag: str, rank: int) -> dict:
    with open(os.path.join(base, "out", f"{tag}-rank{rank}.json")) as f:
        return json.load(f)


def _snap(key_dir: str, owner: int, step: int) -> str:
    return os.path.join(key_dir, f"rank{owner:05d}", f"step-{step:09d}.snap")


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Trained:
    return Trained(str(tmp_path_factory.mktemp("two-nodes")), TWO_NODES)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Trained:
    return Trained(str(tmp_path_factory.mktemp("four-nodes")), FOUR_NODES)


def _durable_steps(job: Trained) -> list[int]:
    return sorted(int(os.path.basename(p)[5:13]) for p in glob.glob(f"{job.base}/ckpt/step-*"))


@pytest.mark.timeout(300)
def test_a_intact_memory_restores_locally(two):
    assert _durable_steps(two) == [4]  # durable holds an older point than memory
    results = two.restore()
    assert {(r["step"], r["tier"]) for r in results} == {(6, "local-memory")}
    assert all(r["bytes_local"] > 0 and r["bytes_peer"] == 0 for r in results)
    assert all(r["tokens_seen"] == 600 for r in results)


@pytest.mark.timeout(300)
def test_b_lost_node_restores_from_peers_without_durable_reads(two):
    step_dir = f"{two.base}/ckpt/step-00000004"
    aside = f"{two.base}/durable-aside"
    os.makedirs(aside, exist_ok=True)
    data = [n for n in os.listdir(step_dir) if n != "COMMIT"]
    for n in data:  # a durable read would now fail: this restore must not need one
        os.rename(os.path.join(step_dir, n), os.path.join(aside, n))
    try:
        results = two.restore(damage=lambda keys: shutil.rmtree(keys["a"]))
    finally:
        for n in data:
            os.rename(os.path.join(aside, n), os.path.join(step_dir, n))
    assert {(r["step"], r["tier"]) for r in results} == {(6, "peer-memory")}
    lost = [r for r in results if TWO_NODES[r["rank"]] == "a"]
    assert all(r["bytes_peer"] > 0 and r["bytes_local"] == 0 for r in lost)
    kept = [r for r in results if TWO_NODES[r["rank"]] == "b"]
    assert all(r["bytes_local"] > 0 and r["bytes_peer"] == 0 for r in kept)


@pytest.mark.timeout(300)
def test_c_lost_node_and_its_peer_fall_back_to_durable(four):
    # rank 1 lives on b and its copy on c: with both gone, no step is complete in memory
    def lose_b_and_c(keys):
        shutil.rmtree(keys["b"])
        shutil.rmtree(keys["c"])

    results = four.restore(damage=lose_b_and_c)
    assert {(r["step"], r["tier"]) for r in results} == {(4, "durable")}
    assert all("complete and good for all 4 ranks" in " ".join(r["skipped"]) for r in results)
    # one node alone is survivable on this ring too: rank 1 fetches from c
    results = four.restore(damage=lambda keys: shutil.rmtree(keys["b"]))
    assert {(r["step"], r["tier"]) for r in results} == {(6, "peer-memory")}
    assert [r["bytes_peer"] > 0 for r in results] == [False, True, False, False]


@pytest.mark.timeout(400)
def test_d_torn_generations_are_never_loaded(two):
    def unfinished(keys):  # a write that never finished, on every node
        for key in keys.values():
            shutil.copy(_snap(key, 1, 6), _snap(key, 1, 7) + ".tmp-12345")
            _truncate(_snap(key, 1, 7) + ".tmp-12345")

    def torn_own_copy(keys):
        unfinished(keys)
        _truncate(_snap(keys["a"], 1, 6))  # rank 1's own copy; its peer (rank 3) has one

    results = two.restore(damage=torn_own_copy)
    assert {(r["step"], r["tier"]) for r in results} == {(6, "peer-memory")}
    assert [r["bytes_peer"] > 0 for r in results] == [False, True, False, False]
    assert "truncated" in " ".join(results[1]["skipped"])

    def flipped_everywhere(keys):  # every copy of rank 1 at step 6: back to step 5
        unfinished(keys)
        for key in keys.values():
            path = _snap(key, 1, 6)
            _flip(path, os.path.getsize(path) - 10)  # a payload byte
        return keys

    results = two.restore(damage=flipped_everywhere)
    assert {(r["step"], r["tier"]) for r in results} == {(5, "local-memory")}
    assert "checksum mismatch" in " ".join(results[1]["skipped"])

    def all_of_rank1(keys):  # wrong magic, a flipped header byte: nothing of rank 1 is good
        for key in keys.values():
            _flip(_snap(key, 1, 6), 0)
            _flip(_snap(key, 1, 5), 40)

    results = two.restore(damage=all_of_rank1)
    assert {(r["step"], r["tier"]) for r in results} == {(4, "durable")}


@pytest.mark.timeout(300)
def test_e_changed_world_size_restores_durable(two):
    results = two.restore(nodes=["a", "b"])
    assert {(r["step"], r["tier"]) for r in results} == {(4, "durable")}
    assert "the job now has 2" in " ".join(results[0]["skipped"])


@pytest.mark.timeout(400)
def test_f_memory_older_than_the_newest_durable_commit_restores_durable(tmp_path):
    job = Trained(str(tmp_path), TWO_NODES)  # memory: steps 5 and 6; durable: step 4
    later = job.memdirs(os.path.join(job.base, "later"))
    for node, src in job.memdirs(os.path.join(job.base, "pristine")).items():
        shutil.copytree(src, later[node])
    run(WORKER, job.args("on-to-8", "8", "crash"), job.nodes, later)  # from step 6 to 8
    assert 8 in _durable_steps(job)
    results = job.restore()  # the nodes hold steps 5 and 6 only (the pristine copies)
    assert {(r["step"], r["tier"]) for r in results} == {(8, "durable")}
    why = " ".join(results[0]["skipped"])
    assert "at or after durable step 8" in why and "newest copy seen: step 6" in why


@pytest.mark.timeout(600)
def test_g_fsdp2_sharded_states_restore_from_memory_bit_exact(tmp_path):
    job = Trained(str(tmp_path), ["a", "b"], parallel="fsdp")  # rank 0 <-> rank 1
    results = job.restore()
    assert {(r["step"], r["tier"]) for r in results} == {(6, "local-memory")}
    results = job.restore(damage=lambda keys: shutil.rmtree(keys["b"]))
    assert {(r["step"], r["tier"]) for r in results} == {(6, "peer-memory")}
    assert [r["bytes_peer"] > 0 for r in results] == [False, True]


@pytest.mark.timeout(600)
def test_a_copy_damaged_in_transit_is_never_published_by_its_peer(tmp_path, monkeypatch):
    """Rank 1's 6th copy reaches rank 3 (its peer, on node b) with a flipped payload byte:
    rank 3 verifies it before giving it a name, so node b never holds it; rank 1's own copy
    of step 6 (node a) is good, and so is every other copy."""
    base = str(tmp_path)
    for d in ("ckpt", "refs", "out"):
        os.makedirs(os.path.join(base, d))
    mem = {n: os.path.join(base, f"mem-{n}") for n in ("a", "b")}
    monkeypatch.setenv("MEMTEST_CORRUPT_SEND", "1:6")
    run(WORKER, [f"{base}/ckpt", f"{base}/refs", f"{base}/out", "t", "6", "crash"], TWO_NODES, mem)
    with open(os.path.join(base, "out", "t-rank3-snapshots.json")) as f:
        said = {e["step"]: e for e in json.load(f)}
    assert [s for s, e in said.items() if not e["ok"]] == [6], said
    assert "received by rank 3" in said[6]["error"] and "checksum" in said[6]["error"]
    a, b = _key_dir(mem["a"]), _key_dir(mem["b"])
    assert not os.path.exists(_snap(b, 1, 6)) and os.path.exists(_snap(b, 1, 5))
    assert os.path.exists(_snap(a, 1, 6)) and os.path.exists(_snap(b, 3, 6))
    assert glob.glob(os.path.join(b, "rank00001", "*.tmp-*")) == []  # nothing half-kept


def test_sigkill_during_snapshots_never_loads_a_torn_generation(tmp_path):
    """Kill one rank at a random moment (then the others, as torchrun does), restart, and
    check every restore is bit-exact with the step it names."""
    rng = random.Random(20261202)
    base = str(tmp_path)
    for d in ("ckpt", "refs", "out"):
        os.makedirs(os.path.join(base, d))
    mem = {n: os.path.join(base, f"mem-{n}") for n in ("a", "b")}
    args = [f"{base}/ckpt", f"{base}/refs", f"{base}/out"]
    cycles = 3  # each cycle is a 4-rank launch (CI time)
    for cycle in range(cycles):
        job = Job(WORKER, args + [f"cycle{cycle}", "0", "forever", "2048"], TWO_NODES, mem)
        ready = [f"{base}/out/cycle{cycle}-rank{r}.json" for r in range(4)]
        deadline = time.monotonic() + 240
        while not all(os.path.exists(p) for p in ready):
            assert all(p.poll() is None for p in job.procs), job.wait(check=False)
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.5, 3.0))  # snapshots run every step: mostly mid-snapshot
        victims = list(range(4))
        rng.shuffle(victims)
        os.kill(job.procs[victims[0]].pid, signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.2))
        for r in victims[1:]:
            # A survivor may have ended by itself already (its peer's socket closed): a forked
            # rank is reaped by the fork server at once, so its pid is gone, not a zombie.
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.procs[r].pid, signal.SIGKILL)
        job.wait(check=False)
    run(WORKER, args + ["final", "0", "crash", "2048"], TWO_NODES, mem)
    results = [_result(base, f"cycle{c}", r) for c in range(1, cycles) for r in range(4)]
    results += [_result(base, "final", r) for r in range(4)]
    for r in results:
        assert r["diff"] == [], f"torn or wrong restore: {r}"
    assert any(r["tier"] != "durable" and r["step"] > 0 for r in results), results
    print([(r["step"], r["tier"]) for r in results if r["rank"] == 0])


def test_a_transfer_of_another_size_than_agreed_is_refused_never_an_aborted_receiver(tmp_path):
    """Gloo aborts a process that receives more bytes than it posted a buffer for, so the
    bytes on the wire are always the agreed size, decided on both ends: a copy whose size
    changed after the all-gather is announced and refused (nothing allocated, nothing sent),
    and a holder whose file changed since the scan sends zeros of the planned size (which
    the owner's checksum refuses). The group still works afterwards."""
    from launch import launch

    launch(os.path.join(HERE, "peer_sizes_worker.py"), [str(tmp_path)], 2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["exchange"]["got"] == {"1": [64, 64 * 2]}  # rank 1's good copy arrived
    assert r1["exchange"]["got"] == {}  # rank 0's was refused: nothing allocated
    assert "200 bytes, 100 were agreed: not sent" in " ".join(r0["exchange"]["problems"])
    assert "announced a copy of 200 bytes, 100 were agreed: refused" in " ".join(
        r1["exchange"]["problems"]
    )
    assert r0["transfer"]["received"] == [100, 0]  # zeros: the checksum refuses them
    assert "300 bytes, 100 were planned" in " ".join(r1["transfer"]["problems"])
    assert r0["after"] == r1["after"] == 3


@pytest.mark.timeout(300)
def test_a_holders_copy_that_grew_since_the_scan_is_refused_and_an_older_step_restores(
    two, monkeypatch
):
    """Node a is lost, so rank 0 fetches its copy from rank 2 (node b); right after the scan
    agreed its size, that copy grows by a page. Rank 2 sends zeros of the planned size (the
    whole file would abort rank 0), rank 0's checksum refuses them, that copy is dropped,
    and every rank restores the older generation, bit for bit; the restore record says
    why step 6 was passed over."""
    monkeypatch.setenv("MEMTEST_GROW_AFTER_SCAN", "2:0")
    results = two.restore(damage=lambda keys: shutil.rmtree(keys["a"]))
    assert {(r["step"], r["tier"]) for r in results} == {(5, "peer-memory")}
    why = " ".join(results[0]["skipped"])
    assert "were planned (it changed since the scan)" in why, why
