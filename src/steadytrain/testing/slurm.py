"""A real Slurm (Debian's ``slurm-wlm``) on the node harness: one ``slurmctld`` on the bridge,
one ``slurmd`` per node namespace, so ``sbatch`` scripts run as they would on a cluster.

``examples/slurm/train.sbatch`` is what users copy; a script nobody ran under Slurm drifts
(options Slurm rejects, steps that behave otherwise on node loss). This runs it for real::

    with NodeHarness(tmp, nodes=2) as h, SlurmCluster(h) as slurm:
        job = slurm.sbatch(["--nodes=1-2", "examples/slurm/train.sbatch"],
                           env=slurm.job_env({"DATASET": url, ...}))
        slurm.wait_job(job, lambda j: j["JobState"] == "RUNNING", "running")
        h.kill(h.nodes[1])               # slurmd, slurmstepd, torchrun, workers: by PID
        slurm.wait_nodes("down", ["node-1"])

What runs where, all under ``ROOT/slurm`` (``ROOT``: the harness's root):

* ``munged`` in the root namespace, key generated here, socket ``munge/munge.socket``: a
  path socket is reachable from every network namespace, so one daemon serves the
  controller, every ``slurmd`` and the clients (``AuthInfo=socket=...``);
* ``slurmctld`` in the root namespace on the bridge address, under the host name
  ``steadytrain-harness`` (a UTS namespace: it only starts on the host SlurmctldHost names);
* per node, ``slurmd -D -N node-K`` in the node's namespace and a UTS namespace whose host
  name is ``node-K``, so ``hostname``, ``SLURMD_NODENAME`` and the rank files all say
  ``node-K``; the node's tmpfs is bind-mounted at ``local-disk`` (one path, each node's own
  disk). It is started through the harness (``popen``): ``h.kill(node)`` takes it down with
  the job steps under it, and ``h.close()`` reaps it.

No cgroups (``proctrack/linuxproc``, ``task/none``), no accounting database (``sacct`` has
nothing to read: jobs are observed with ``scontrol show job`` and ``squeue``; ``MinJobAge``
keeps finished jobs visible), ``SlurmUser=root``, ``ReturnToService=2``, ``SlurmdTimeout``
of 5 s so a killed node is DOWN quickly, and ``cred_expire`` of 10 s (a requeued job waits
that long; 120 s by default). Every daemon and client gets ``SLURM_CONF`` pointing here: the
machine's ``/etc/slurm`` is never read or written. Only mode ``netns`` is supported (every
``slurmd`` listens on the same port, one per address); ``SlurmUnavailable`` says why
otherwise, as when ``slurm-wlm`` is missing (``scripts/ensure-slurm.sh`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

from steadytrain.testing import netns
from steadytrain.testing.nodes import MARK_ENV, Node, NodeHarness, env_without_proxies
from steadytrain.testing.ports import free_ports
from steadytrain.testing.slurm_conf import hosts_file, slurm_conf, slurmctld_shell, slurmd_shell

__all__ = ["BINARIES", "SlurmCluster", "SlurmStartError", "SlurmUnavailable", "missing_binaries"]

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "unshare")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed, or the harness has no namespaces)."""


class SlurmStartError(RuntimeError):
    """A daemon exited while starting: a fault to fix, not a reason to skip."""


def missing_binaries() -> list[str]:
    """The programs of ``BINARIES`` not on PATH (``slurm-wlm`` and ``munge`` provide them)."""
    return [b for b in BINARIES if _which(b) is None]


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class SlurmCluster:
    """munged + slurmctld + one slurmd per harness node; see the module docstring."""

    def __init__(
        self,
        h: NodeHarness,
        *,
        partition: str = "steady",
        slurmd_timeout_s: int = 5,
        requeue_delay_s: int = 10,
        cpus: int = 2,
    ) -> None:
        self.h = h
        self.partition = partition
        self.slurmd_timeout_s = slurmd_timeout_s
        self.requeue_delay_s = requeue_delay_s
        self.cpus = cpus
        self.dir = os.path.join(h.root, "slurm")
        self.conf_path = os.path.join(self.dir, "slurm.conf")
        self.munge_socket = os.path.join(self.dir, "munge", "munge.socket")
        # Where every node sees its own tmpfs (NODE_CACHE), bind-mounted in its namespace.
        self.local_cache = os.path.join(self.dir, "local-disk")
        self.munged: subprocess.Popen[Any] | None = None
        self.slurmctld: subprocess.Popen[Any] | None = None
        self.slurmds: dict[str, subprocess.Popen[Any]] = {}
        self._logs: list[Any] = []
        self._stopped: set[int] = set()  # what close() stopped, for leftovers()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(
                f"{', '.join(missing)} not found: install Debian's slurm-wlm "
                "(scripts/ensure-slurm.sh does, as root)"
            )
        if self.h.mode != "netns":
            raise SlurmUnavailable(
                f"the node harness runs in mode {self.h.mode} ({self.h.reason}); one slurmd "
                "per node needs a network namespace per node (root, `ip netns add`)"
            )
        try:
            for sub in ("munge", "state", "logs", "spool", "local-disk"):
                os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
            self._start_munged()
            self._write_hosts()
            self._start_slurmctld()
            for node in self.h.nodes:
                self._start_slurmd(node)
            for node in self.h.nodes:
                self._wait(
                    lambda n=node: "idle" in self.nodes().get(n.name, "").split("+"),
                    f"{node.name} to register idle",
                    self.slurmds[node.name],
                    f"slurmd-{node.name}.out",
                    timeout,
                )
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _daemon(self, argv: list[str], log: str, env: Mapping[str, str] | None = None) -> Any:
        out = open(os.path.join(self.dir, "logs", log), "w")  # noqa: SIM115 - closed in close()
        self._logs.append(out)
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def _start_munged(self) -> None:
        """munged refuses keys, sockets and logs in directories others may write: the
        directory is 0711 and the key 0400, both root's."""
        mdir = os.path.dirname(self.munge_socket)
        os.chmod(mdir, 0o711)  # clients need to reach the socket; none may list or write
        key = os.path.join(mdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munged = self._daemon(
            [
                _which("munged") or "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={os.path.join(mdir, 'munged.pid')}",
                f"--log-file={os.path.join(mdir, 'munged.log')}",
                f"--seed-file={os.path.join(mdir, 'munged.seed')}",
            ],
            "munged.out",
        )
        self._wait(
            lambda: os.path.exists(self.munge_socket), "munged's socket", self.munged, "munged.out"
        )

    def _write_hosts(self) -> None:
        """Every node resolves every other node's name: the harness's hosts files only list
        the nodes made before each one. Rewritten in place, as a running namespace sees
        the file bind-mounted."""
        nodes = [(n.name, n.addr) for n in self.h.nodes]
        for node in self.h.nodes:
            text = hosts_file(self.h.host_addr, nodes, node.name, socket.gethostname())
            with open(os.path.join(netns.ETC_NETNS, node.netns or "", "hosts"), "r+") as f:
                f.truncate()
                f.write(text)

    def _write_conf(self) -> None:
        self.ctld_port = free_ports(1, self.h.host_addr)[0]
        text = slurm_conf(
            root=self.dir,
            cluster=f"steady{self.h.tag}",
            host_addr=self.h.host_addr,
            ctld_port=self.ctld_port,
            munge_socket=self.munge_socket,
            nodes=[(n.name, n.addr) for n in self.h.nodes],
            partition=self.partition,
            slurmd_timeout_s=self.slurmd_timeout_s,
            cred_expire_s=self.requeue_delay_s,
            cpus=self.cpus,
        )
        with open(self.conf_path, "w") as f:
            f.write(text)

    def _start_slurmctld(self, attempts: int = 3) -> None:
        """slurmctld binds the port written in slurm.conf, found free just before: another
        process may take it in between, so a start that lost that race starts again on a
        fresh port (the slurmds, started after, read the final config)."""
        inner = slurmctld_shell(_which("slurmctld") or "slurmctld", self.conf_path)
        for attempt in range(attempts):
            self._write_conf()
            self.slurmctld = self._daemon(
                ["unshare", "--uts", "sh", "-c", inner], "slurmctld.out", self.env()
            )
            try:
                self._wait(
                    lambda: "UP" in self.scontrol("ping", check=False).stdout,
                    "slurmctld to answer `scontrol ping`",
                    self.slurmctld,
                    "slurmctld.out",
                )
                return
            except SlurmStartError as e:
                if "Address already in use" not in str(e) or attempt == attempts - 1:
                    raise

    def _start_slurmd(self, node: Node) -> None:
        os.makedirs(os.path.join(self.dir, "spool", node.name), exist_ok=True)
        exe = _which("slurmd") or "slurmd"
        inner = slurmd_shell(exe, self.conf_path, node.name, node.cache_dir, self.local_cache)
        self.slurmds[node.name] = self.h.popen(
            node,
            ["unshare", "--uts", "sh", "-c", inner],
            log_path=os.path.join(self.dir, "logs", f"slurmd-{node.name}.out"),
            env={"SLURM_CONF": self.conf_path},
        )

    def revive(self, node: Node, *, timeout: float = 60.0) -> None:
        """Start ``node``'s slurmd again (after ``h.kill``) and wait until it is idle:
        ``ReturnToService=2`` returns a DOWN node to service when it registers."""
        proc = self.slurmds.get(node.name)
        if proc is None or proc.poll() is not None:
            self._start_slurmd(node)
        self._wait(
            lambda: "idle" in self.nodes().get(node.name, "").split("+"),
            f"{node.name} to register idle",
            self.slurmds[node.name],
            f"slurmd-{node.name}.out",
            timeout,
        )

    def _wait(self, pred: Any, what: str, proc: Any, log: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if proc is not None and proc.poll() is not None:
                log = os.path.join(self.dir, "logs", log)
                with open(log, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise SlurmStartError(
                    f"`{shlex.join(proc.args)}` exited {proc.returncode} while waiting for "
                    f"{what}; its log ({log}) ends:\n{tail}\nsee also {self.dir}/logs"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s; see {self.dir}/logs")
            time.sleep(0.2)

    def close(self) -> None:
        """slurmds go with their nodes (``h.close()``, or here first); then slurmctld and
        munged, by PID: SIGTERM, and SIGKILL after the harness's grace."""
        for proc in self.slurmds.values():
            if proc.poll() is None:
                netns.kill_pids(self.h.process_tree(proc), grace_s=self.h.grace_s)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for proc in (self.slurmctld, self.munged):
            if proc is not None and proc.poll() is None:
                tree = self.h.process_tree(proc)  # slurmctld forks slurmscriptd, which has no path
                self._stopped |= tree
                netns.kill_pids(tree, grace_s=self.h.grace_s)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for f in self._logs:
            f.close()
        self._logs.clear()

    def leftovers(self) -> list[str]:
        """Slurm processes of this cluster still running (empty once closed)."""
        procs = [("munged", self.munged), ("slurmctld", self.slurmctld)]
        procs += [(f"slurmd of {k}", p) for k, p in self.slurmds.items()]
        out = [f"{what} pid {p.pid}" for what, p in procs if p is not None and p.poll() is None]
        for pid in os.listdir("/proc"):  # anything started with our config, key or socket
            mine = pid.isdigit() and (self.dir in _cmdline(pid) or int(pid) in self._stopped)
            if mine and netns.alive(int(pid)):  # a zombie has finished
                out.append(f"process {pid}: {_cmdline(pid)[:200]}")
        return out

    # -- clients -----------------------------------------------------------------------

    def env(
        self, extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """``base`` (this process's environment) and ``extra``, plus what a Slurm client
        needs: ``SLURM_CONF`` here, the daemons' directories on PATH."""
        env = {**(os.environ if base is None else base), **(extra or {})}
        env["SLURM_CONF"] = self.conf_path
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def job_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """What a job submitted with ``sbatch`` (which exports the submitting environment)
        needs on this cluster: the object store's credentials and endpoint (node-0's link:
        a job's environment is the same on every node), gloo on ``eth0``, no HTTP proxy,
        one thread. No ``STEADYTRAIN_NODE``: ranks name their node by host name, the UTS
        name ``node-K`` here, as on a cluster."""
        assert self.h.server is not None, "start() the harness first"
        env = env_without_proxies()
        for drop in ("STEADYTRAIN_NODE", MARK_ENV, "NODE_CACHE", "NODE_ADDR"):
            env.pop(drop, None)
        env.update(
            {
                "AWS_ACCESS_KEY_ID": self.h.server.access_key,
                "AWS_SECRET_ACCESS_KEY": self.h.server.secret_key,
                "STEADYTRAIN_S3_ENDPOINT": self.h.nodes[0].link.endpoint,
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return self.env(extra, base=env)

    def cmd(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (``sbatch``, ``scontrol``, ``squeue``...) against this cluster,
        in ``env`` (from ``env()`` or ``job_env()``; default: ``env()``)."""
        r = subprocess.run(
            list(argv), capture_output=True, text=True, env=env or self.env(), timeout=60
        )
        if check and r.returncode != 0:
            raise RuntimeError(
                f"`{shlex.join(argv)}` exited {r.returncode}: {r.stderr.strip()[-2000:]} "
                f"(logs: {self.dir}/logs)"
            )
        return r

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cmd(["scontrol", *args], check=check)

    def sbatch(self, args: Sequence[str], *, env: Mapping[str, str] | None = None) -> str:
        """``sbatch --parsable ARGS`` (submitted from the root namespace, as from a login
        node); returns the job id. The job inherits ``env`` (e.g. ``job_env({...})``)."""
        out = self.cmd(["sbatch", "--parsable", *args], env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (JobState, NodeList, Restarts, ...)."""
        text = self.scontrol("show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def nodes(self) -> dict[str, str]:
        """{node: state} from ``sinfo``-free ``scontrol show node -o``."""
        out = {}
        for line in self.scontrol("show", "node", "-o").stdout.splitlines():
            f = dict(re.findall(r"(\w+)=(\S*)", line))
            if "NodeName" in f:
                out[f["NodeName"]] = f.get("State", "").lower().replace("*", "")
        return out

    def wait_nodes(self, state: str, names: Sequence[str], *, timeout: float = 60.0) -> None:
        """Wait until every node of ``names`` has ``state`` (``idle``, ``down``...)."""

        def ok(got: dict[str, str]) -> bool:
            return all(state in got.get(n, "").split("+") for n in names)

        self._poll(self.nodes, ok, f"nodes {list(names)} {state}", timeout)

    def wait_job(
        self, job_id: str, pred: Any, what: str, *, timeout: float = 300.0
    ) -> dict[str, str]:
        """Poll ``job(job_id)`` until ``pred(job)``; returns that job record."""
        return self._poll(lambda: self.job(job_id), pred, f"job {job_id}: {what}", timeout)

    def _poll(self, get: Any, pred: Any, what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not pred(got := get()):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what}: not within {timeout:.0f} s; now {got}; see {self.dir}/logs"
                )
            time.sleep(0.4)
        return got
