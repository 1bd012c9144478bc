"""Remote checkpoints go through ``storage.Store`` (issue 11, item 1), tested against a real
SeaweedFS server with the endpoint given only by ``STEADYTRAIN_S3_ENDPOINT`` and the
credentials only by ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``:

1. ``Checkpointer(remote="s3://…")`` honours the endpoint variable (it used to go to AWS);
2. a PUT that never gets an answer ends in ``ReadDeadlineError`` (it used to hang);
3. ``steadytrain checkpoints s3://…`` with wrong credentials or a dead endpoint exits 2 with
   a one-paragraph error (it used to print a traceback).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import s3fs
import torch
from torch import nn

from steadytrain.checkpoint import Checkpointer
from steadytrain.checkpoint.remote import Root
from steadytrain.errors import ReadDeadlineError
from steadytrain.testing.s3_server import free_ports

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

_OTHER_ENDPOINTS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE")


def _states(value: float) -> dict:
    model = nn.Linear(32, 16)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return {"model": model}


@pytest.fixture
def env_only(s3_server, monkeypatch):
    """Point this process at the server through the environment alone; returns a function
    that sets a different endpoint (a proxy) the same way."""

    def use(endpoint: str) -> None:
        monkeypatch.setenv("STEADYTRAIN_S3_ENDPOINT", endpoint)
        # s3fs caches clients by their arguments, not by the environment they read.
        s3fs.S3FileSystem.clear_instance_cache()

    for var in _OTHER_ENDPOINTS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    use(s3_server.endpoint)
    yield use
    s3fs.S3FileSystem.clear_instance_cache()


def _cli(url: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _OTHER_ENDPOINTS}
    return subprocess.run(
        [sys.executable, "-m", "steadytrain.cli", "checkpoints", url, "--json"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_remote_checkpoint_uses_the_endpoint_from_the_environment(
    s3_server, s3_bucket, env_only, tmp_path
):
    events: list[dict] = []
    ckpt = Checkpointer(
        str(tmp_path / "node0"),
        every_steps=1,
        keep_last=2,
        async_mode="thread",
        remote=s3_bucket,  # no storage_options: the endpoint comes from the environment
        on_event=events.append,
    )
    for step in (1, 2, 3):
        ckpt.maybe_save(step, _states(float(step)))
    ckpt.close()
    assert [e["ok"] for e in events] == [True, True, True], events

    # The objects are on the SeaweedFS server (checked with an independent client).
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    prefix = s3_bucket.removeprefix("s3://")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix)) == [
        ".writer-lease",  # the writer lease (docs/checkpoint.md)
        "step-00000002",
        "step-00000003",
    ]
    assert json.loads(fs.cat_file(f"{prefix}/step-00000003/COMMIT"))["step"] == 3

    # Restore on a node with an empty local directory, still with only the environment.
    states = _states(-1.0)
    other = Checkpointer(str(tmp_path / "node1"), async_mode="sync", remote=s3_bucket)
    assert other.restore_latest(states) == 3
    assert torch.all(states["model"].weight == 3.0)

    # Discovery from the command line: a fresh process that knows only the environment.
    out = _cli(
        s3_bucket,
        {
            "STEADYTRAIN_S3_ENDPOINT": s3_server.endpoint,
            "AWS_ACCESS_KEY_ID": s3_server.access_key,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        },
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["checkpoints"]
    assert [(r["step"], r["state"], r["verifies"]) for r in rows] == [
        (3, "committed", True),
        (2, "committed", True),
    ]


class StallPuts:
    """A loopback TCP proxy to the S3 server that forwards every request except uploads:
    a connection whose request starts with ``PUT`` is held open and never answered, the
    way a dead link or a wedged gateway leaves a client waiting."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.stalled_puts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        with self._lock:
            self._socks += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        stalled = False
        try:
            while data := client.recv(1 << 16):
                if not stalled and data.startswith(b"PUT "):
                    stalled = True  # swallow this request and everything after it
                    with self._lock:
                        self.stalled_puts += 1
                if not stalled:
                    upstream.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                s.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()


def test_hung_put_ends_in_a_deadline_error(s3_server, s3_bucket, env_only, tmp_path, monkeypatch):
    proxy = StallPuts(s3_server.ports["s3.port"])
    try:
        env_only(proxy.endpoint)
        # Small enough to keep the test short, large enough that the (forwarded) listing
        # requests of a loaded machine still finish inside one attempt.
        monkeypatch.setenv("STEADYTRAIN_STORAGE_TIMEOUT_S", "2")
        monkeypatch.setenv("STEADYTRAIN_STORAGE_RETRY_S", "5")
        events: list[dict] = []
        ckpt = Checkpointer(
            str(tmp_path / "local"),
            every_steps=1,
            async_mode="sync",
            remote=s3_bucket,
            on_event=events.append,
        )
        ckpt.maybe_save(1, _states(1.0))  # listing works; every upload hangs
        ckpt.close()
        assert len(events) == 1 and events[0]["ok"] is False
        assert "ReadDeadlineError" in events[0]["error"], events[0]["error"]
        # The first PUT of a job's first save is its writer lease (docs/checkpoint.md).
        assert f"{s3_bucket}/.writer-lease/" in events[0]["error"], events[0]["error"]
        assert "STEADYTRAIN_STORAGE_RETRY_S" in events[0]["error"]
        assert proxy.stalled_puts >= 2, "the PUT reached the stalled link and was retried"

        # The same through the Root API: the error type, naming the object and the fix.
        local = tmp_path / "files"
        local.mkdir()
        (local / "blob").write_bytes(b"x" * 1000)
        with pytest.raises(
            ReadDeadlineError,
            match=f"{s3_bucket}/step-00000009/blob at {proxy.endpoint}: .*RETRY_S",
        ):
            Root(s3_bucket).upload(str(local), "step-00000009", ["blob"])
    finally:
        proxy.close()
    # Nothing was committed: the failed save left no COMMIT on the server.
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    assert not fs.exists(f"{s3_bucket.removeprefix('s3://')}/step-00000001/COMMIT")


def test_checkpoints_command_wrong_credentials_exits_2(s3_server, s3_bucket):
    out = _cli(
        s3_bucket,
        {
            "STEADYTRAIN_S3_ENDPOINT": s3_server.endpoint,
            "AWS_ACCESS_KEY_ID": s3_server.access_key,
            "AWS_SECRET_ACCESS_KEY": "not-the-secret",
        },
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    error = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(error) == 1, out.stderr
    assert s3_bucket in error[0] and s3_server.endpoint in error[0]
    assert "access denied" in error[0] and "AWS_SECRET_ACCESS_KEY" in error[0]


def test_checkpoints_command_dead_endpoint_exits_2(s3_server, s3_bucket):
    (dead_port,) = free_ports(1)  # nothing listens there
    out = _cli(
        s3_bucket,
        {
            "STEADYTRAIN_S3_ENDPOINT": f"http://127.0.0.1:{dead_port}",
            "AWS_ACCESS_KEY_ID": s3_server.access_key,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
            "STEADYTRAIN_STORAGE_TIMEOUT_S": "1",
            "STEADYTRAIN_STORAGE_RETRY_S": "1",
        },
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    error = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(error) == 1, out.stderr
    assert s3_bucket in error[0] and f"127.0.0.1:{dead_port}" in error[0]
    assert "check that the endpoint is up" in error[0]
