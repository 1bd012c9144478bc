"""One writer per checkpoint root on a real S3 server (SeaweedFS): conditional creates, the
writer lease on a remote root, and directory claims from two writers that share only the
bucket (issue 12 item 1)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from steadytrain.storage.store import Store
from steadytrain.testing import forkserver

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]

WORKER = os.path.join(
    os.path.dirname(__file__), "..", "distributed", "checkpoint", "lease_worker.py"
)

# Two processes claim the same steps on one remote, each from its own local directory (two
# nodes, or two jobs): only the store's create-if-absent can keep them apart.
CLAIMER = """
import json, os, sys, time
from steadytrain.checkpoint.claim import claim_name
from steadytrain.checkpoint.remote import Root
local, url, go, ready = sys.argv[1:5]
remote = Root(url, json.loads(os.environ["LEASE_TEST_STORAGE_OPTIONS"]))
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
print(json.dumps([claim_name(Root(local), remote, step) for step in range(1, 16)]))
"""


def _env(server) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    env["LEASE_TEST_STORAGE_OPTIONS"] = json.dumps(server.storage_options)
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_create_if_absent_on_a_real_s3_server(s3_server, s3_bucket):
    store = Store(s3_bucket, s3_server.storage_options)
    assert store.write_bytes_if_absent("step-00000001/CLAIM", b"first") is True
    assert store.write_bytes_if_absent("step-00000001/CLAIM", b"second") is False
    assert store.read_bytes("step-00000001/CLAIM") == b"first"


def test_claims_from_two_writers_on_one_bucket_never_share_a_directory(
    s3_server, s3_bucket, tmp_path
):
    go = tmp_path / "go"
    # Every process here is forked from the fork server (torch imported once per test
    # process): each is still a process of its own, with its own pid, lease and client.
    procs = [
        forkserver.popen(
            [sys.executable, "-c", CLAIMER, str(tmp_path / f"node{i}"), s3_bucket, str(go)]
            + [str(tmp_path / f"ready{i}")],
            env=_env(s3_server),
            merge=False,
        )
        for i in (0, 1)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in (0, 1)):  # both are waiting
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "the claimers never started"
        time.sleep(0.02)
    go.touch()
    names = []
    for p in procs:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err
        names.append(json.loads(out))
    assert len(set(names[0]) | set(names[1])) == 30, names  # every name went to one only
    store = Store(s3_bucket, s3_server.storage_options)
    for name in names[0] + names[1]:
        assert json.loads(store.read_bytes(f"{name}/CLAIM"))["token"]


def test_a_second_job_on_the_same_remote_root_is_refused(s3_server, s3_bucket, tmp_path):
    ready = tmp_path / "a.ready"
    env = _env(s3_server)
    a = forkserver.popen(
        [sys.executable, WORKER, str(tmp_path / "a"), "--base", "1000", "--steps", "1"]
        + ["--hold", "--ready", str(ready), "--remote", s3_bucket],
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert a.poll() is None, a.communicate(timeout=60)[0]
            assert time.monotonic() < deadline, "job a never held the root"
            time.sleep(0.05)
        # Another node: its own local directory, the same bucket prefix.
        b = forkserver.run(
            [sys.executable, WORKER, str(tmp_path / "b"), "--base", "2000", "--steps", "1"]
            + ["--remote", s3_bucket],
            env=env,
            timeout=120,
        )
        assert b.returncode == 3, b.stdout + b.stderr
        assert f"{s3_bucket} is the checkpoint root of another live job" in b.stdout, b.stdout
        assert f"pid {a.pid}" in b.stdout and f"{s3_bucket}/.writer-lease/" in b.stdout
    finally:
        a.kill()
        a.communicate()
