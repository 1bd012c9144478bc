"""Who a checkpoint writer is: the job identity a restart keeps, and the host and process
facts that tell a live lease holder on this host from a dead one (``lease.py``)."""

from __future__ import annotations

import os
import socket

__all__ = ["job_identity", "host_identity", "proc_start", "pid_gone"]


def job_identity(explicit: str = "") -> str:
    """The identity a restart of this job keeps: ``explicit``, else torchrun's run id (its
    default ``none`` is not an identity: every job without ``--rdzv-id`` has it), else the
    Slurm job id (kept across ``scontrol requeue``); "" when none is known."""
    if explicit:
        return explicit
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run and run.lower() != "none":
        return f"torchelastic:{run}"
    slurm = os.environ.get("SLURM_JOB_ID", "")
    return f"slurm:{slurm}" if slurm else ""


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_start(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of ``pid`` from /proc; None when it does not exist
    (or there is no /proc: then the caller falls back to ``os.kill(pid, 0)``)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the command name may hold spaces
    return fields[0], fields[19]


def host_identity() -> dict[str, str]:
    """What makes two pids comparable: same host name, same boot, same pid namespace."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return {
        "host": socket.gethostname(),
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
        "pid_ns": pid_ns,
    }


def pid_gone(pid: int, start: str | None) -> bool:
    """True when ``pid`` (started at ``start``) no longer runs on this host."""
    if os.path.isdir("/proc/self"):
        now = proc_start(pid)
        return now is None or now[0] == "Z" or (start is not None and now[1] != start)
    try:
        os.kill(pid, 0)  # no /proc: existence only
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, as another user's process
    return False
