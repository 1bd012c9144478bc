"""A size-limited tmpfs mount: a small disk that fills up, for full-disk tests (and, later,
a node's local NVMe in the node harness). Mounting needs root; where it is not allowed the
caller is told why, so a test can skip with that reason."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

__all__ = ["TmpfsUnavailable", "tmpfs"]


class TmpfsUnavailable(RuntimeError):
    """This process may not mount a tmpfs here (not root, or inside a restricted sandbox)."""


@contextlib.contextmanager
def tmpfs(path: str | os.PathLike[str], size: str) -> Iterator[str]:
    """Mount a tmpfs of ``size`` (``mount -o size=``, e.g. ``"1M"``) on ``path`` (created if
    missing) for the ``with`` block; lazily unmounted afterwards even if the block failed."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
    )
    if r.returncode != 0:
        raise TmpfsUnavailable(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
