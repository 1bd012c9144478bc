"""What a harness node has of its own (steadytrain.testing.nodes): its local disks, each a
size-limited tmpfs (or a plain directory where mounting is refused), its environment, and
its processes (``process_tree``).

A node has two such disks: ``cache`` (its local NVMe: staged shards) and ``memory`` (its RAM:
the checkpoint memory tier's snapshots, ``STEADYTRAIN_MEMORY_DIR``). A lost machine loses
its RAM, so ``NodeHarness.kill`` empties the memory disk once the node's processes are dead
(``empty_dir``): a restore that reads a dead node's memory cannot happen in a test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import psutil

from steadytrain.testing.tmpfs import TmpfsUnavailable, tmpfs

__all__ = [
    "PROXY_VARS",
    "empty_dir",
    "env_without_proxies",
    "mount_disk",
    "node_env",
    "process_tree",
]

PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "ftp_proxy"}


def env_without_proxies() -> dict[str, str]:
    """This process's environment less any HTTP proxy variable: node traffic stays on the
    harness's own addresses (the bridge, loopback), never a proxy elsewhere."""
    return {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARS}


def mount_disk(
    mounts: contextlib.ExitStack,
    path: str,
    size: str,
    *,
    node: str,
    what: str,
    log: Callable[[str], None],
) -> bool:
    """A tmpfs of ``size`` on ``path`` until ``mounts`` closes; True when mounted. Where
    mounting is refused (not root, a sandbox) ``path`` is a plain directory, and the log
    says so: ``what`` names the disk (``local disk``, ``memory``)."""
    try:
        mounts.enter_context(tmpfs(path, size))
        return True
    except TmpfsUnavailable as e:
        os.makedirs(path, exist_ok=True)
        log(f"[nodes] {node}: {what} is a plain directory ({e})")
        return False


def empty_dir(path: str) -> int:
    """Remove everything under ``path`` (the directory, a mount point, stays). Returns the
    number of entries removed at the top level."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)
            removed += 1
    return removed


def node_env(
    *,
    name: str,
    addr: str,
    mark: str,
    cache_dir: str,
    memory_dir: str,
    endpoint: str,
    access_key: str,
    secret_key: str,
    in_netns: bool,
) -> dict[str, str]:
    """A node's processes' environment: this one's less proxies, plus the node's identity,
    disks, object-store link and credentials. ``mark``: ``MARK_ENV=VALUE``."""
    env = env_without_proxies()
    key, value = mark.split("=", 1)
    env.update(
        {
            "STEADYTRAIN_NODE": name,
            "NODE_CACHE": cache_dir,
            # The memory tier's node-local directory: this node's RAM, no one else's.
            "NODE_MEMORY": memory_dir,
            "STEADYTRAIN_MEMORY_DIR": memory_dir,
            "NODE_ADDR": addr,
            key: value,
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "STEADYTRAIN_S3_ENDPOINT": endpoint,
            "GLOO_SOCKET_IFNAME": "eth0" if in_netns else "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # torchrun's agent-shared TCPStore hands restarted workers stale gloo
            # addresses (pytorch/pytorch#135712): every attempt gets a fresh store.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    return env


def process_tree(proc: subprocess.Popen[Any]) -> set[int]:
    """``proc`` and every descendant still running (empty once ``proc`` ended)."""
    if proc.poll() is not None:
        return set()
    try:
        return {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(True))}
    except psutil.NoSuchProcess:
        return set()
