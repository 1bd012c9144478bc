"""The text ``steadytrain.testing.slurm`` hands to Slurm: slurm.conf, each node's hosts file
and the shell lines that start the daemons in their namespaces.

Pure functions of names, addresses and paths, kept apart from the process handling so each
setting that makes Slurm run on network namespaces of one machine reads in one place, with
the reason next to it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

__all__ = ["HEAD", "SLURMD_PORT", "hosts_file", "slurm_conf", "slurmctld_shell", "slurmd_shell"]

HEAD = "steadytrain-harness"  # the bridge address's name: slurmctld's host name
SLURMD_PORT = 6818  # one slurmd per namespace: each has the port to itself


def slurm_conf(
    *,
    root: str,
    cluster: str,
    host_addr: str,
    ctld_port: int,
    munge_socket: str,
    nodes: Sequence[tuple[str, str]],
    partition: str = "steady",
    slurmd_timeout_s: int = 5,
    cred_expire_s: int = 20,
    cpus: int = 2,
) -> str:
    """slurm.conf for ``nodes`` ((name, address) pairs); every path lives under ``root``."""
    t = slurmd_timeout_s
    lines = [
        f"ClusterName={cluster}",
        f"SlurmctldHost={HEAD}({host_addr})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also delays a requeued job's restart (120 s by default).
        f"AuthInfo=socket={munge_socket},cred_expire={cred_expire_s}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",  # %n: the node's name, one directory each
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/spool/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/logs/slurmctld.log",
        f"SlurmdLogFile={root}/logs/slurmd-%n.log",
        "MailProg=/bin/true",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroups: a node namespace has none of its own, and nothing here limits a job.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/linear",
        "SchedulerType=sched/builtin",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "ReturnToService=2",  # a DOWN node that registers again is back in service
        "JobRequeue=1",
        f"SlurmdTimeout={t}",  # a killed node is DOWN after seconds, not minutes
        "SlurmctldTimeout=10",
        f"MessageTimeout={max(2, t // 2)}",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=600",  # no accounting: finished jobs stay in `scontrol show job`
        "SlurmdParameters=config_overrides",  # every node says CPUs={cpus}: one machine
        "SchedulerParameters=sched_interval=2",
        "PropagateResourceLimits=NONE",
    ]
    lines += [f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in nodes]
    names = ",".join(n for n, _ in nodes)
    lines.append(f"PartitionName={partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def hosts_file(host_addr: str, nodes: Sequence[tuple[str, str]], me: str, aliases: str) -> str:
    """Node ``me``'s /etc/hosts: every node by name (torchrun's master address is the host
    name of the node that got rank 0), the bridge as ``HEAD``, and ``aliases`` (the
    machine's own host name) on ``me``'s address."""
    lines = ["127.0.0.1 localhost", f"{host_addr} {HEAD}"]
    lines += [f"{a} {n}{' ' + aliases if n == me else ''}" for n, a in nodes]
    return "\n".join(lines) + "\n"


def slurmctld_shell(exe: str, conf: str) -> str:
    """For ``unshare --uts sh -c``: slurmctld only starts on the host SlurmctldHost names,
    and a UTS namespace gives it that name without touching the machine's."""
    return f"hostname {HEAD} && exec {shlex.quote(exe)} -D -i -f {shlex.quote(conf)}"


def slurmd_shell(exe: str, conf: str, name: str, cache_dir: str, local_cache: str) -> str:
    """For ``ip netns exec NS unshare --uts sh -c``: node ``name``'s slurmd.

    ``ip netns exec`` mounts a fresh /sys, without the cgroup file systems, and slurmd
    22.05 initialises its cgroup plugin even with proctrack/linuxproc and task/none ("No
    filesystem mounted on /sys/fs/cgroup ... slurmd initialization failed"). An empty tmpfs
    there (in the node's private mount namespace) reads as cgroup v1 with no controller,
    plus the named ``systemd`` hierarchy its check stats (the machine's own; nothing here
    creates a cgroup). ``cache_dir`` (the node's tmpfs) is bind-mounted at ``local_cache``:
    one path, each node's own disk, as ``/local_nvme`` on a cluster.
    """
    q = shlex.quote
    return (
        "mount -t tmpfs -o size=1M,mode=755 slurm-nocgroup /sys/fs/cgroup && "
        "mkdir /sys/fs/cgroup/systemd && "
        "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && "
        f"mount --bind {q(cache_dir)} {q(local_cache)} && "
        f"hostname {q(name)} && exec {q(exe)} -D -N {q(name)} -f {q(conf)}"
    )
