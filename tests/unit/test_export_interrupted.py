"""``steadytrain export`` stopped half-way, or raced by someone else (issue 40, section 5).

A real ``steadytrain export`` process builds a 128 MiB checkpoint's export under its hidden
temporary name beside DEST; the test waits for that temporary to appear and stops the
process there with SIGSTOP (the export is then deterministically mid-way, whatever the
machine's speed), acts (a signal, a directory made at DEST), and lets it go on:

- SIGTERM or SIGINT: the temporary is removed (the docs say a failed export leaves
  nothing), the exit status says which signal;
- SIGKILL: the temporary stays (nothing can run), and the next export to the same DEST
  removes it, but never one of a live process or of another host;
- an empty DEST made meanwhile is never replaced: the export fails naming it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from steadytrain import Checkpointer
from steadytrain.testing import forkserver

CLI = os.path.join(os.path.dirname(sys.executable), "steadytrain")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> str:
    """A checkpoint root whose export takes long enough to be caught building."""
    root = tmp_path_factory.mktemp("big") / "ckpts"
    torch.manual_seed(0)
    ckpt = Checkpointer(str(root), async_mode="sync")
    ckpt.save(1, {"model": nn.Linear(8192, 4096, bias=False)})  # 128 MiB
    ckpt.close()
    return str(root)


def _temporaries(dest: Path) -> list[str]:
    return sorted(n for n in os.listdir(dest.parent) if n.startswith(f".{dest.name}.tmp-"))


def _stopped_export(root: str, dest: Path) -> tuple[subprocess.Popen, Path]:
    """``steadytrain export ROOT --to dcp --out DEST``, SIGSTOPped once its temporary beside
    DEST holds a file (the shard being written); the process and the temporary."""
    p = forkserver.popen(
        [CLI, "export", root, "--to", "dcp", "--out", str(dest), "--quiet"], merge=False
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        tmps = _temporaries(dest)
        if tmps and os.listdir(dest.parent / tmps[0]):
            p.send_signal(signal.SIGSTOP)
            break
        time.sleep(0.001)
    assert p.poll() is None, f"the export ended before it was caught: {p.communicate()}"
    assert not dest.exists(), "the export finished before it was stopped"
    (tmp,) = _temporaries(dest)
    return p, dest.parent / tmp


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    p.send_signal(signal.SIGCONT)
    _, err = p.communicate(timeout=240)
    return p.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_export_removes_its_temporary(big, tmp_path, sig) -> None:
    dest = tmp_path / "out"
    p, tmp = _stopped_export(big, dest)
    assert tmp.is_dir() and os.listdir(tmp)  # a checkpoint's worth of bytes, on their way
    p.send_signal(sig)
    rc, err = _finish(p)
    assert not tmp.exists() and _temporaries(dest) == [], "the temporary export was left"
    assert not dest.exists()
    assert rc == 128 + sig, (rc, err[-2000:])  # the status of a process stopped by sig
    assert "Traceback" not in err


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_what_sigkill_leaves_is_removed_by_the_next_export_to_that_dest(big, tmp_path) -> None:
    dest = tmp_path / "out"
    p, killed = _stopped_export(big, dest)
    p.kill()
    p.communicate(timeout=60)
    assert killed.is_dir(), "SIGKILL leaves the temporary (docs/checkpoint.md says so)"
    # Not to be touched: another host's export (DEST on a shared disk), a live process's,
    # and a link (removed as a link: the directory it points at stays whole).
    other_host = dest.parent / f".out.tmp-not-{socket.gethostname()}-{_dead_pid()}-0123abcd"
    live = dest.parent / f".out.tmp-{socket.gethostname()}-{os.getpid()}-0123abcd"
    victim = tmp_path / "victim"
    for d in (other_host, live, victim):
        d.mkdir()
        (d / "keep").write_text("mine")
    link = dest.parent / f".out.tmp-{socket.gethostname()}-{_dead_pid()}-abcdef01"
    link.symlink_to(victim)
    out = forkserver.run(
        [CLI, "export", big, "--to", "dcp", "--out", str(dest), "--quiet"], timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert not killed.exists(), "the killed export's temporary is still there"
    assert not os.path.lexists(link) and (victim / "keep").read_text() == "mine"
    assert _temporaries(dest) == sorted([other_host.name, live.name])
    assert all((d / "keep").read_text() == "mine" for d in (other_host, live))


def test_a_dest_made_during_the_export_is_never_replaced(big, tmp_path) -> None:
    dest = tmp_path / "out"
    p, tmp = _stopped_export(big, dest)
    dest.mkdir()  # someone else's, empty: a rename would silently replace it
    rc, err = _finish(p)
    assert rc == 2, err[-2000:]
    assert f"{dest}: appeared while exporting" in err and "--out" in err
    assert dest.is_dir() and os.listdir(dest) == [], "the directory made meanwhile was replaced"
    assert not tmp.exists() and _temporaries(dest) == []
