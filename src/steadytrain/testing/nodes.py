"""K nodes on one machine: a network namespace, a node-local disk and a torchrun agent each.

End-to-end tests elsewhere run every rank on one address with one cache directory. Real
jobs span nodes, and the failures steadytrain exists for happen on one node among many, so
this harness makes a node real enough to lose, cut off or slow down on its own::

    with NodeHarness(tmp_path, nodes=2) as h:
        url = h.put_dataset(local_dataset, "ds")
        agents = [h.torchrun(n, 1, ["-m", "steadytrain.cli", "train", "demo", ...],
                             run_id="job", nnodes="1:2") for n in h.nodes]
        h.kill(h.nodes[1])            # a lost machine: every process of the node, by PID
        h.partition(h.nodes[1])       # its link goes down
        h.slow_storage(h.nodes[1], latency_s=0.05, down_bps=2e6)
        h.cpu_quota(h.nodes[1], 0.2)  # its processes get a fifth of a core from now on
        spare = h.add_node(); h.stage(spare, url)

Topology (mode ``netns``, the default where possible):

* a bridge in the root namespace owning ``10.213.N.1/24`` (N: the first /24 of 10.213/16
  that no interface here uses); node k is namespace ``st-TAG-nK`` with ``eth0`` at
  ``10.213.N.(10+k)``, a veth into the bridge, and no default route: a node reaches the
  bridge address and its peers, nothing else;
* on the bridge address the harness hosts the c10d rendezvous store (outside every node, as
  a login node's service would be) and, per node, a ``SlowLink`` in front of one real
  SeaweedFS server (which itself listens on loopback only): all of a node's object-store
  traffic crosses its own link, so one node's storage can be slowed alone;
* each node has a size-limited tmpfs as its local disk (``NODE_CACHE``), another as its
  memory (``NODE_MEMORY``, exported as ``STEADYTRAIN_MEMORY_DIR``: where the checkpoint memory
  tier keeps its snapshots; ``kill`` empties it, as a lost machine loses its RAM), and its own
  environment: ``STEADYTRAIN_NODE=node-k``, the S3 endpoint of its link and credentials,
  ``GLOO_SOCKET_IFNAME=eth0`` (gloo would otherwise pick the address of the machine's host
  name, which no namespace has), and no HTTP proxy variables;
* each torchrun agent gets ``--local-addr`` = its node's address, so the workers' master
  address is a node address too;
* the machine's ``/sys/fs/cgroup`` is visible inside every node (``ip netns exec`` remounts
  ``/sys``: the harness binds the tree back before the node's command starts,
  steadytrain.testing.cgroups), so a rank reads its own cgroup's quota and throttling;
  ``cpu_quota`` puts a node's processes in a cgroup of their own with a CPU quota (cgroup
  v1), the way a Slurm job's or a container's limit slows one node of a cluster.

Mode ``loopback`` (forced with ``mode="loopback"``, or chosen when namespaces cannot be
made: no ``ip``, not root, or ``ip`` refused): nodes are distinct ``127.0.0.(10+k)``
addresses in the root namespace, servers listen on 127.0.0.1, and ``partition`` is not
available. The mode and its reason are printed when the harness starts.

How a node's process starts (mode netns): a Python command line (``sys.executable -m
MODULE``/``SCRIPT``/``-c``, what ``run``, ``stage`` and ``torchrun`` start) is forked from
the test process's fork server (``testing.forkserver``, torch imported once) and enters the
node before it runs (``testing.node_entry``: ``setns`` to the node's network namespace, a
mount namespace of its own with the node's ``/etc/hosts``, ``/sys`` and the cgroup view, as
``ip netns exec`` and ``NODE_SHELL`` make them); a child that cannot enter fails loudly
(``NodeEntryFailed``), it never runs in the machine's namespaces. A torchrun agent's CLI
ranks (``-m steadytrain.cli``) fork in turn from the node's warm process
(``testing.node_warm``, itself forked into the node; ``torchrun(warm=False)`` keeps them
fresh). Anything else starts fresh through ``ip netns exec``: other programs (Slurm's
daemons, ``sh``), a caller that needs ``stdin`` or a stdout stream to read line by line,
loopback mode, and every process with ``STEADYTRAIN_TEST_FRESH=1``.

A fresh process of a node carries ``STEADYTRAIN_NODE_HARNESS=TAG/node-k`` in its
environment; a forked one has it in ``os.environ`` only (``/proc/PID/environ`` shows the
fork server's), so a node's processes are the marked ones, plus its namespace's (``ip
netns pids``), plus the descendants of what the harness started there. ``close()`` sends them SIGTERM, then
SIGKILL by PID to any still running after ``grace_s`` (saying which), unmounts the disks,
deletes namespaces, veths and the bridge, and stops the servers; ``leftovers()`` lists
anything that survived (a test asserts it is empty).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any, Literal

import psutil

from steadytrain.testing import forkserver, netns
from steadytrain.testing.cgroups import (
    NODE_SHELL,
    CgroupView,
    NodeQuota,
    leftover_cgroups,
)
from steadytrain.testing.forkserver import ForkedProcess
from steadytrain.testing.netns import NetnsUnavailable, ip
from steadytrain.testing.node_local import (
    empty_dir,
    env_without_proxies,
    mount_disk,
    node_env,
    process_tree,
)
from steadytrain.testing.node_warm import NodeWarm, warm_args
from steadytrain.testing.s3_server import SeaweedServer
from steadytrain.testing.slowlink import SlowLink

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["MARK_ENV", "Node", "NodeHarness", "env_without_proxies"]

MARK_ENV = "STEADYTRAIN_NODE_HARNESS"


Mode = Literal["auto", "netns", "loopback"]
# A node's process: fresh (``ip netns exec``) or forked into the node (``forkserver``).
Proc = subprocess.Popen[Any] | ForkedProcess
# What a forked child takes of ``subprocess.Popen``'s arguments (output to a file, a pipe,
# the caller's own stdout and stderr; a working directory); anything else starts fresh.
_FORK_KWARGS = frozenset({"stdout", "stderr", "text", "cwd"})


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _output(target: Any, inherited: int) -> Any:
    """A forked child's stdout or stderr: ``target``, or (None) the caller's own fd, which a
    fresh process would inherit."""
    return inherited if target is None else target


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Node:
    """One node: its name, address, namespace (None in loopback mode), disks and link."""

    name: str
    index: int
    addr: str
    netns: str | None
    cache_dir: str
    cache_tmpfs: bool
    memory_dir: str
    memory_tmpfs: bool
    link: SlowLink
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    logs: list[IO[Any]] = field(default_factory=list)
    cgroup_view: str | None = None  # the machine's /sys/fs/cgroup, bound by the harness

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this node (inside its namespace: ``ip netns exec`` and the
        shell that binds the cgroup view exec the command in place, so the PID the caller
        gets is the command's own)."""
        if not self.netns:
            return list(argv)
        if self.cgroup_view is None:
            return ["ip", "netns", "exec", self.netns, *argv]
        shell = ["sh", "-c", NODE_SHELL, self.cgroup_view]
        return ["ip", "netns", "exec", self.netns, *shell, *argv]


class NodeHarness:
    """K nodes, a SeaweedFS server and a rendezvous store; see the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        nodes: int = 2,
        *,
        mode: Mode = "auto",
        cache_size: str = "64M",
        memory_size: str = "256M",
        bucket: str = "steady",
        grace_s: float = 3.0,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        if mode not in ("auto", "netns", "loopback"):
            raise ValueError(f"mode={mode!r}: use 'auto', 'netns' or 'loopback'")
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: a harness needs at least 1 node")
        self.root = os.path.abspath(os.fspath(root))
        self.initial_nodes = nodes
        self.requested_mode = mode
        self.cache_size = cache_size
        self.memory_size = memory_size
        self.bucket = bucket
        self.grace_s = grace_s
        self.log = log
        self.tag = secrets.token_hex(3)
        self.mode: Literal["netns", "loopback"] = "loopback"
        self.reason = ""
        self.nodes: list[Node] = []
        self.host_addr = "127.0.0.1"  # where nodes reach the store, the links, rendezvous
        self.bridge: str | None = None
        self._prefix = ""  # 10.213.N in mode netns
        self.server: SeaweedServer | None = None
        self.store: TCPStore | None = None
        self.killed_at_teardown: list[tuple[str, int, str]] = []  # (node, pid, cmdline)
        self._mounts = contextlib.ExitStack()
        self._namespaces: list[str] = []
        self.cgroup_view: str | None = None
        self._quotas: dict[str, NodeQuota] = {}
        self._warm = NodeWarm(self._start_warm, log)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> NodeHarness:
        try:
            self._choose_mode()
            self.server = SeaweedServer(os.path.join(self.root, "seaweed"))
            self.server.start()
            self.server.make_bucket(self.bucket)
            self.store = self._rendezvous_store()
            for _ in range(self.initial_nodes):
                self.add_node()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> NodeHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _choose_mode(self) -> None:
        if self.requested_mode == "loopback":
            self.reason = "forced (mode='loopback')"
        else:
            try:
                netns.check_netns()
                self.bridge, self._prefix = netns.make_bridge(self.tag)
                self.host_addr = f"{self._prefix}.1"
                self.mode, self.reason = "netns", f"bridge {self.bridge} at {self.host_addr}/24"
            except NetnsUnavailable as e:
                if self.requested_mode == "netns":
                    raise
                self.reason = f"network namespaces unavailable: {e}"
        if self.mode == "netns":
            self.log(f"[nodes] mode netns: one network namespace per node ({self.reason})")
            view = CgroupView(os.path.join(self.root, "cgroup"))
            try:
                self.cgroup_view = self._mounts.enter_context(view.mounted())
            except (OSError, subprocess.CalledProcessError) as e:
                why = getattr(e, "stderr", None) or e
                self.log(f"[nodes] /sys/fs/cgroup stays invisible inside nodes: {why}")
        else:
            self.log(f"[nodes] mode loopback: nodes at 127.0.0.x, {self.reason}")

    def _rendezvous_store(self) -> TCPStore:
        """The c10d store every agent joins with ``is_host=false``, on a port the kernel
        picks as it binds (no agent has to win a port race)."""
        from torch.distributed import TCPStore

        return TCPStore(
            self.host_addr,
            0,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=timedelta(seconds=300),
        )

    @property
    def rendezvous_endpoint(self) -> str:
        assert self.store is not None, "start() the harness first"
        return f"{self.host_addr}:{self.store.port}"

    # -- nodes -------------------------------------------------------------------------

    def add_node(self) -> Node:
        """A new node (a spare, once the first ones run): namespace, disk, link, env."""
        assert self.server is not None, "start() the harness first"
        k = len(self.nodes)
        name = f"node-{k}"
        ns = None
        if self.mode == "netns":
            ns, addr = f"st-{self.tag}-n{k}", f"{self._prefix}.{10 + k}"
            self._namespaces.append(ns)
            hosts = [f"{self.host_addr} steadytrain-harness"]
            hosts += [f"{n.addr} {n.name}" for n in self.nodes]
            hosts.append(f"{addr} {socket.gethostname()} {name}")  # its own host name
            netns.add_namespace(ns, f"st{self.tag}h{k}", self.bridge or "", addr, hosts)
        else:
            addr = f"127.0.0.{10 + k}"
        disks = {d: os.path.join(self.root, "nodes", name, d) for d in ("cache", "memory")}
        sizes = {"cache": (self.cache_size, "local disk"), "memory": (self.memory_size, "memory")}
        on_tmpfs = {
            d: mount_disk(self._mounts, disks[d], size, node=name, what=what, log=self.log)
            for d, (size, what) in sizes.items()
        }
        link = SlowLink(self.server.ports["s3.port"], listen_host=self.host_addr)
        env = node_env(
            name=name,
            addr=addr,
            mark=f"{MARK_ENV}={self.tag}/{name}",
            cache_dir=disks["cache"],
            memory_dir=disks["memory"],
            endpoint=link.endpoint,
            access_key=self.server.access_key,
            secret_key=self.server.secret_key,
            in_netns=ns is not None,
        )
        node = Node(
            name, k, addr, ns, disks["cache"], on_tmpfs["cache"], disks["memory"],
            on_tmpfs["memory"], link, env, cgroup_view=self.cgroup_view,
        )  # fmt: skip
        self.nodes.append(node)
        return node

    def popen(
        self,
        node: Node,
        argv: Sequence[str],
        *,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        fork: bool | None = None,
        **kwargs: Any,
    ) -> Proc:
        """Start ``argv`` on ``node`` with its environment (plus ``env``); output goes to
        ``log_path`` when given. The harness tracks the process for kill and teardown.

        ``fork``: None forks a Python command line (``forkserver.forks``) into the node
        when ``can_fork`` says it can, else starts it fresh; True insists on the fork
        (``ValueError`` where it cannot); False starts it fresh (``ip netns exec``). A
        forked child is a ``ForkedProcess`` (no ``stdin``, no ``stdout`` stream to read
        line by line: a caller that needs those passes ``stdin=``/``stdout=PIPE`` and gets
        a fresh process, or ``fork=False``)."""
        if log_path is not None:
            out = open(log_path, "w")  # noqa: SIM115 - closed at kill/teardown
            node.logs.append(out)
            kwargs.setdefault("stdout", out)
            kwargs.setdefault("stderr", subprocess.STDOUT)
        streams = subprocess.PIPE in (kwargs.get("stdout"), kwargs.get("stderr"))
        ok = self.can_fork(node, argv, kwargs)
        if fork and not ok:
            raise ValueError(f"{list(argv)[:3]} cannot be forked into {node.name}: "
                             f"mode {self.mode}, arguments {sorted(kwargs)}")  # fmt: skip
        full_env = {**node.env, **(env or {})}
        proc: Proc
        if ok and (fork or (fork is None and not streams)):
            assert node.netns is not None
            proc = forkserver.popen(
                argv,
                env=full_env,
                cwd=kwargs.get("cwd"),
                stdout=_output(kwargs.get("stdout"), 1),
                stderr=_output(kwargs.get("stderr"), 2),
                node=(node.netns, node.cgroup_view),
            )
        else:
            proc = subprocess.Popen(node.argv(argv), env=full_env, **kwargs)
        node.procs.append(proc)
        return proc

    def can_fork(self, node: Node, argv: Sequence[str], kwargs: dict[str, Any]) -> bool:
        """Whether ``argv`` (with ``subprocess.Popen``'s ``kwargs``) can be forked into
        ``node``: mode netns, a Python command line the fork server runs, no
        ``STEADYTRAIN_TEST_FRESH=1``, and only arguments a forked child takes (text output,
        no ``DEVNULL``)."""
        if node.netns is None or not forkserver.forks(argv) or not set(kwargs) <= _FORK_KWARGS:
            return False
        outputs = (kwargs.get("stdout"), kwargs.get("stderr"))
        if subprocess.DEVNULL in outputs:
            return False
        # A forked child's pipes are read back as text: bytes asked for start fresh.
        return subprocess.PIPE not in outputs or bool(kwargs.get("text"))

    def run(
        self, node: Node, argv: Sequence[str], *, timeout: float = 120, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``node`` to completion (text output captured); on time-out the
        node's process is killed by PID and ``TimeoutExpired`` raised."""
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fork = kwargs.pop("fork", None)
        if fork is None:  # read to the end here: no stream to read line by line
            fork = self.can_fork(node, argv, {k: v for k, v in kwargs.items() if k != "env"})
        proc = self.popen(node, argv, fork=fork, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            netns.kill_pids(self.process_tree(proc))
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def torchrun(
        self,
        node: Node,
        nproc: int,
        args: Sequence[str],
        *,
        run_id: str,
        nnodes: str = "1",
        max_restarts: int = 0,
        rdzv_conf: str = "",
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        warm: bool | None = None,
        fork: bool | None = None,
    ) -> Proc:
        """This node's torchrun agent (``args``: what follows, e.g. ``["-m",
        "steadytrain.cli", "train", ...]``), joined to the harness's rendezvous store.

        ``warm``: None (auto) has the CLI's ranks (``-m steadytrain.cli ...``) fork from
        the node's warm process (``node_warm``) where ``can_warm``, else start fresh; False
        keeps them fresh (a test of the cold path, or of freshness itself); True insists.
        ``fork``: the agent's own start, as ``popen`` takes it."""
        args, warm_env = self._warm_ranks(node, list(args), warm)
        if warm_env:
            env = {**(env or {}), **warm_env}
        conf = ",".join(c for c in ("is_host=false", rdzv_conf) if c)
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rendezvous_endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}",
            f"--local-addr={node.addr}",
            "--monitor-interval=0.2",
            *args,
        ]
        return self.popen(node, argv, log_path=log_path, env=env, fork=fork)

    # -- warm ranks --------------------------------------------------------------------

    def can_warm(self, node: Node) -> bool:
        """Whether ``node``'s ranks can fork from a warm process: its warm process can be
        forked into it (``can_fork``)."""
        return self.can_fork(node, [sys.executable, "-m", "steadytrain.warm"], {})

    def prewarm(self, nodes: Sequence[Node], args: Sequence[str]) -> None:
        """Start each node's warm process now (not waited for) when torchrun's script
        ``args`` run the CLI: a job on several nodes starts them together, then each agent
        waits for its own."""
        from steadytrain.train.demo_run import train_entry

        if warm_args(list(args), train_entry()) is None:
            return
        for node in nodes:
            if self.can_warm(node):
                self._warm.start(node, train_entry())

    def _warm_ranks(
        self, node: Node, args: list[str], warm: bool | None
    ) -> tuple[list[str], dict[str, str]]:
        """torchrun's script arguments and the agent's extra environment for ``warm``."""
        from steadytrain.train.demo_run import train_entry
        from steadytrain.warm.protocol import ENV_SOCKET

        entry = warm_args(args, train_entry())
        if warm is False or (warm is None and (entry is None or not self.can_warm(node))):
            return args, {}
        if entry is None or not self.can_warm(node):
            raise ValueError(f"warm ranks on {node.name} need mode netns, a fork server and "
                             f"the CLI's ranks (-m steadytrain.cli): {args[:3]}")  # fmt: skip
        self.prewarm([node], args)
        sock = self._warm.socket(node)
        return (entry, {ENV_SOCKET: sock}) if sock else (args, {})

    def _start_warm(self, node: Node, argv: list[str], log_path: str) -> Proc:
        return self.popen(node, [sys.executable, *argv], log_path=log_path, fork=True)

    def workers(self, node: Node, agent: Proc) -> list[psutil.Process]:
        """The training processes ``agent`` (a torchrun agent on ``node``) started: its
        children that run steadytrain, or, where they entered the node's warm process (the
        agent's child is then ``steadytrain.warm.enter``), the workers that process forked."""
        kids = [p for p in psutil.Process(agent.pid).children() if "steadytrain" in _cmd(p)]
        if not any("steadytrain.warm.enter" in _cmd(p) for p in kids):
            return kids
        warm = self.warm_pid(node)
        return psutil.Process(warm).children() if warm else []

    def warm_pid(self, node: Node) -> int | None:
        """The pid of ``node``'s warm process while it runs (None: none started, or gone)."""
        return self._warm.pid(node)

    # -- operations --------------------------------------------------------------------

    def pids(self, node: Node) -> set[int]:
        """Every live process of ``node``: marked, in its namespace, or started by it."""
        found = netns.marked_pids(f"{MARK_ENV}={self.tag}/{node.name}")
        if node.netns:
            found |= netns.netns_pids(node.netns)
        for proc in node.procs:
            found |= self.process_tree(proc)
        return found

    process_tree = staticmethod(process_tree)

    def kill(self, node: Node) -> set[int]:
        """A lost machine: SIGKILL every process of ``node`` by PID, then empty its memory
        (its RAM goes with it; its disk stays). Returns the PIDs."""
        pids: set[int] = set()
        # Again until none is left: a process may start a child between listing and kill.
        while found := self.pids(node) - pids:
            netns.kill_pids(found)
            pids |= found
        for proc in node.procs:
            proc.wait()
        emptied = empty_dir(node.memory_dir)
        self.log(f"[nodes] killed {node.name}: pids {sorted(pids)}; memory emptied "
                 f"({emptied} entries)")  # fmt: skip
        return pids

    def partition(self, node: Node, *, down: bool = True) -> None:
        """Take ``node``'s link down (``down=False`` brings it back): its processes keep
        running and reach neither the store, the rendezvous nor the other nodes."""
        if node.netns is None:
            raise RuntimeError(
                f"partition({node.name}) needs mode netns; this harness runs in loopback "
                f"mode ({self.reason}). Run as root where `ip netns add` works"
            )
        ip("-n", node.netns, "link", "set", "eth0", "down" if down else "up")
        self.log(f"[nodes] {node.name}: link {'down' if down else 'up'}")

    def slow_storage(
        self, node: Node, *, latency_s: float = 0.0, down_bps: float | None = None
    ) -> None:
        """Slow ``node``'s object-store link from now on (both directions get the latency;
        ``down_bps`` caps what the node receives); zeros and None restore full speed."""
        node.link.down.latency = node.link.up.latency = latency_s
        node.link.down.bandwidth = down_bps
        self.log(f"[nodes] {node.name}: storage link latency {latency_s}s, down {down_bps} B/s")

    def cpu_quota(self, node: Node, cores: float | None) -> set[int]:
        """Limit ``node`` to ``cores`` CPUs from now on (0.2: a fifth of one core), as a
        job's cgroup quota does: every process of the node moves into the node's own cgroup
        (their children follow), and the quota is set on it; None lifts it. Returns the
        PIDs moved. Needs root and cgroup v1 (else ``testing.cgroups.CgroupUnavailable``)."""
        q = self._quotas.get(node.name)
        if q is None:
            q = self._quotas[node.name] = NodeQuota(self.tag, node.name)
        q.set(cores)
        moved: set[int] = set()
        # Again until none is new: a process may start a child between listing and moving.
        while found := self.pids(node) - moved:
            moved |= q.add(found) | found
        moved &= q.pids()
        self.log(f"[nodes] {node.name}: CPU quota {cores} cores on pids {sorted(moved)}")
        return moved

    def stage(self, node: Node, dataset: str, *, timeout: float = 120) -> dict[str, Any]:
        """``steadytrain stage DATASET --cache NODE_CACHE --json`` on ``node`` (through its
        own link); returns the JSON report, raising with stderr when it fails."""
        argv = [sys.executable, "-m", "steadytrain.cli", "stage", dataset]
        r = self.run(node, [*argv, "--cache", node.cache_dir, "--json"], timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"stage on {node.name} exited {r.returncode}: {r.stderr[-3000:]}")
        return json.loads(r.stdout)

    def put_dataset(self, local_dir: str, key: str) -> str:
        """Upload a local dataset directory into the bucket; returns its ``s3://`` URL."""
        import s3fs

        assert self.server is not None, "start() the harness first"
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.server.storage_options)
        fs.put(local_dir.rstrip("/") + "/", f"{self.bucket}/{key}/", recursive=True)
        return f"s3://{self.bucket}/{key}"

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop everything the harness started; stuck processes are killed by PID."""
        for node in self.nodes:
            stuck = netns.kill_pids(self.pids(node), grace_s=self.grace_s)
            for pid, cmd in stuck:
                self.log(f"[nodes] {node.name}: pid {pid} ignored SIGTERM, killed: {cmd}")
                self.killed_at_teardown.append((node.name, pid, cmd))
            for proc in node.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            for f in node.logs:
                f.close()
            node.link.close()
        for name, q in self._quotas.items():
            if not q.remove():
                self.log(f"[nodes] {name}: cgroup {q.path} still holds {sorted(q.pids())}")
        self._quotas.clear()
        self._warm.close()
        self._mounts.close()
        for k, ns in enumerate(self._namespaces):
            netns.remove_namespace(ns, f"st{self.tag}h{k}")
        self._namespaces.clear()
        if self.bridge is not None:
            ip("link", "del", self.bridge, check=False)
            self.bridge = None
        if self.server is not None:
            self.server.kill()
        self.store = None

    def leftovers(self) -> list[str]:
        """What teardown left behind: namespaces, links, mounts, processes (empty: clean)."""
        out = []
        if self.mode == "netns":
            out += netns.leftovers(f"st-{self.tag}", f"st{self.tag}")
        with open("/proc/mounts") as f:
            for line in f:
                where = line.split()[1]
                if where.startswith(self.root + os.sep) or f"st-{self.tag}" in where:
                    out.append(f"mount {where}")
        for node in self.nodes:
            out += [f"process {p} of {node.name}" for p in sorted(self.pids(node))]
        out += leftover_cgroups(self.tag)
        if self.server is not None and self.server.proc is not None:
            out.append(f"SeaweedFS process {self.server.proc.pid}")
        return out
