"""The text the Slurm test cluster is started with (``steadytrain.testing.slurm_conf``):
the settings that make Slurm run on network namespaces of one machine, checked without
starting it (``tests/nodes/test_nodes_slurm.py`` starts it)."""

from __future__ import annotations

import shlex

from steadytrain.testing.slurm_conf import (
    HEAD,
    hosts_file,
    slurm_conf,
    slurmctld_shell,
    slurmd_shell,
)

NODES = [("node-0", "10.213.7.10"), ("node-1", "10.213.7.11")]


def _conf(**kw) -> dict[str, str]:
    text = slurm_conf(
        root="/r/slurm",
        cluster="steadyabc",
        host_addr="10.213.7.1",
        ctld_port=40001,
        munge_socket="/r/slurm/munge/munge.socket",
        nodes=NODES,
        **kw,
    )
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key in ("NodeName", "PartitionName"):
            key = f"{key}={value.split()[0]}"
        out[key] = value
    return out


def test_conf_has_what_namespaces_need() -> None:
    c = _conf(slurmd_timeout_s=4, cred_expire_s=15)
    assert c["SlurmctldHost"] == f"{HEAD}(10.213.7.1)" and c["SlurmctldPort"] == "40001"
    assert c["AuthInfo"] == "socket=/r/slurm/munge/munge.socket,cred_expire=15"
    assert c["ProctrackType"] == "proctrack/linuxproc" and c["TaskPlugin"] == "task/none"
    assert c["SlurmdTimeout"] == "4" and c["ReturnToService"] == "2"
    assert c["SlurmdSpoolDir"] == "/r/slurm/spool/%n"  # one spool per node
    assert c["NodeName=node-1"] == "node-1 NodeAddr=10.213.7.11 CPUs=2 State=UNKNOWN"
    assert "Nodes=node-0,node-1" in c["PartitionName=steady"]
    # every path the daemons write is under the cluster's root
    paths = [v for k, v in c.items() if k.endswith(("File", "Dir", "Location"))]
    assert paths and all(p.startswith("/r/slurm/") for p in paths)


def test_hosts_file_names_every_node_and_aliases_only_its_own() -> None:
    text = hosts_file("10.213.7.1", NODES, "node-1", "machine")
    assert f"10.213.7.1 {HEAD}" in text.splitlines()
    assert "10.213.7.10 node-0" in text.splitlines()
    assert "10.213.7.11 node-1 machine" in text.splitlines()


def test_daemon_shells_quote_paths_and_set_host_names() -> None:
    sh = slurmd_shell("/usr/sbin/slurmd", "/r x/slurm.conf", "node-1", "/r x/c", "/r x/l")
    assert shlex.split(sh)[-5:] == ["-D", "-N", "node-1", "-f", "/r x/slurm.conf"]
    assert "mount --bind '/r x/c' '/r x/l'" in sh
    assert "hostname node-1 && exec /usr/sbin/slurmd -D -N node-1 -f '/r x/slurm.conf'" in sh
    assert slurmctld_shell("slurmctld", "/c").startswith(f"hostname {HEAD} && exec slurmctld")
