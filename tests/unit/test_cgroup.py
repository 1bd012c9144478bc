"""This process's own CPU cgroup (monitor/cgroup.py) and the host sampler that reads it
(monitor/rank_recorder.py, ``HostSampler``), over fake trees: a temporary directory stands
for ``/proc`` and another for ``/sys/fs/cgroup``, laid out as cgroup v1 (a Slurm job's
nested cgroup), v2 (unified and hybrid) and a container's own subtree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from steadytrain.monitor.cgroup import CpuCgroup, cpu_quota, own_cpu_cgroup, throttled_s
from steadytrain.monitor.rank_recorder import HostSampler

V1_JOB = "/slurm/uid_1000/job_7/step_0"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(root: Path, cgroup: str, *, loadavg: str = "0.1 0.1 0.1 2/100 99\n") -> str:
    proc = root / "proc"
    _write(proc / "self" / "cgroup", cgroup)
    _write(proc / "loadavg", loadavg)
    _write(proc / "stat", "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 50 0 50 400 0 0 0 0 0 0\n")
    return str(proc)


def _v1_dir(d: Path, *, quota_us: int = -1, period_us: int = 100_000, thr_ns: int = 0) -> None:
    _write(d / "cpu.cfs_quota_us", f"{quota_us}\n")
    _write(d / "cpu.cfs_period_us", f"{period_us}\n")
    _write(d / "cpu.stat", f"nr_periods 10\nnr_throttled 3\nthrottled_time {thr_ns}\n")


def _v1_tree(root: Path, mount: str = "cpu,cpuacct") -> tuple[str, str, Path]:
    """(proc, cgroup root, the job's directory): a Slurm job nested 4 deep, a quota of
    1.5 cores on job_7 and none elsewhere; this machine's root cpu.stat shows nothing."""
    sys_cg = root / "sys"
    base = sys_cg / mount
    _v1_dir(base)
    for part in ("slurm", "slurm/uid_1000", "slurm/uid_1000/job_7"):
        _v1_dir(base / part, quota_us=150_000 if part.endswith("job_7") else -1)
    leaf = base / V1_JOB.lstrip("/")
    _v1_dir(leaf, thr_ns=2_000_000_000)
    proc = _proc(root, f"12:memory:/x\n4:cpu,cpuacct:{V1_JOB}\n1:name=systemd:/y\n0::/z\n")
    return proc, str(sys_cg), leaf


def test_v1_nested_job_cgroup_is_found_with_its_ancestors_quota(tmp_path: Path) -> None:
    proc, sys_cg, leaf = _v1_tree(tmp_path)
    cg = own_cpu_cgroup(proc, sys_cg)
    assert cg is not None and cg.version == 1
    base = os.path.join(sys_cg, "cpu,cpuacct")
    assert cg.dirs[0] == str(leaf) and os.path.normpath(cg.dirs[-1]) == base
    assert len(cg.dirs) == 5  # step_0, job_7, uid_1000, slurm, the root
    assert cpu_quota(cg) == pytest.approx(1.5)  # job_7's, inherited by its step
    assert throttled_s(cg)[str(leaf)] == pytest.approx(2.0)


@pytest.mark.parametrize("mount", ["cpu", "cpuacct,cpu"])
def test_v1_cpu_controller_under_its_other_mount_names(tmp_path: Path, mount: str) -> None:
    proc, sys_cg, leaf = _v1_tree(tmp_path, mount)
    cg = own_cpu_cgroup(proc, sys_cg)
    assert cg is not None and cg.dirs[0] == str(leaf)
    assert cpu_quota(cg) == pytest.approx(1.5)


def test_v1_the_smallest_quota_on_the_path_binds(tmp_path: Path) -> None:
    proc, sys_cg, leaf = _v1_tree(tmp_path)
    _v1_dir(leaf, quota_us=25_000, period_us=100_000)  # the step: a quarter core
    assert cpu_quota(own_cpu_cgroup(proc, sys_cg)) == pytest.approx(0.25)


def test_v1_container_subtree_mounted_as_the_root(tmp_path: Path) -> None:
    """No cgroup namespace: /proc/self/cgroup names the host's path (/docker/ID) while the
    container sees its own subtree as the mount's root."""
    sys_cg = tmp_path / "sys"
    _v1_dir(sys_cg / "cpu", quota_us=50_000, thr_ns=7_000_000_000)
    proc = _proc(tmp_path, "3:cpu,cpuacct:/docker/abc123\n")
    cg = own_cpu_cgroup(proc, str(sys_cg))
    assert cg is not None and cg.dirs == (str(sys_cg / "cpu"),)
    assert cpu_quota(cg) == pytest.approx(0.5)
    assert throttled_s(cg) == {str(sys_cg / "cpu"): pytest.approx(7.0)}


def _v2_dir(d: Path, cpu_max: str | None = None, thr_us: int | None = None) -> None:
    _write(d / "cgroup.controllers", "cpu io memory pids\n")
    if cpu_max is not None:
        _write(d / "cpu.max", cpu_max + "\n")
    stat = "usage_usec 5000\nuser_usec 4000\nsystem_usec 1000\n"
    if thr_us is not None:
        stat += f"nr_periods 10\nnr_throttled 4\nthrottled_usec {thr_us}\n"
    _write(d / "cpu.stat", stat)


@pytest.mark.parametrize("hybrid", [False, True])
def test_v2_unified_path_quota_and_throttling(tmp_path: Path, hybrid: bool) -> None:
    sys_cg = tmp_path / "sys"
    base = sys_cg / "unified" if hybrid else sys_cg
    _v2_dir(base)  # the root has no cpu.max
    _v2_dir(base / "kubepods.slice", "max 100000", thr_us=0)
    pod = base / "kubepods.slice" / "pod-a" / "ctr-1"
    _v2_dir(pod.parent, "200000 100000", thr_us=100)
    _v2_dir(pod, "50000 100000", thr_us=3_500_000)
    proc = _proc(tmp_path, "0::/kubepods.slice/pod-a/ctr-1\n")
    cg = own_cpu_cgroup(proc, str(sys_cg))
    assert cg is not None and cg.version == 2 and cg.dirs[0] == str(pod)
    assert len(cg.dirs) == 4
    assert cpu_quota(cg) == pytest.approx(0.5)
    thr = throttled_s(cg)
    assert thr[str(pod)] == pytest.approx(3.5) and thr[str(pod.parent)] == pytest.approx(1e-4)
    assert str(base) not in thr  # the root's cpu.stat has no throttled_usec


def test_a_v1_cpu_controller_wins_over_the_hybrid_unified_tree(tmp_path: Path) -> None:
    proc, sys_cg, leaf = _v1_tree(tmp_path)
    _v2_dir(Path(sys_cg) / "unified", "10000 100000", thr_us=9)
    cg = own_cpu_cgroup(proc, sys_cg)
    assert cg is not None and cg.version == 1 and cg.dirs[0] == str(leaf)


def test_nothing_readable_is_unknown_never_unlimited(tmp_path: Path) -> None:
    assert own_cpu_cgroup(str(tmp_path / "none"), str(tmp_path / "none")) is None
    assert cpu_quota(None) is None and throttled_s(None) == {}
    proc = _proc(tmp_path, "garbage\n4:cpu:relative/path\n")
    assert own_cpu_cgroup(proc, str(tmp_path / "sys")) is None
    cg = CpuCgroup(1, (str(tmp_path / "missing"),))
    assert cpu_quota(cg) is None and throttled_s(cg) == {}


def test_host_sampler_reports_its_own_cgroups_throttling_and_quota(tmp_path: Path) -> None:
    """The sampler reads the job's nested cgroup, not the root's: 1 s throttled of the
    interval since the last sample shows as a share; the quota caps the usable cores."""
    proc, sys_cg, leaf = _v1_tree(tmp_path)
    _v1_dir(leaf, quota_us=50_000, thr_ns=0)  # half a core
    h = HostSampler(every_s=0.0, proc=proc, cgroup_root=sys_cg)
    assert h.cgroup is not None and h.cgroup.dirs[0] == str(leaf)
    h._thr = (h._thr[0] - 2.0, h._thr[1])  # the last sample: 2 s ago
    _v1_dir(leaf, quota_us=50_000, thr_ns=1_000_000_000)
    s = h.sample()
    assert 0.45 <= s["host_throttled"] <= 0.5  # 1 s of ~2 s
    assert s["host_cpus"] == 1.0 and s["host_run_queue"] == 1.0


def test_host_sampler_follows_a_process_moved_into_a_throttled_cgroup(tmp_path: Path) -> None:
    """Moved mid-run (as the node harness does to inject a quota): the new cgroup is read
    from the next sample on, its throttling from the one after."""
    proc, sys_cg, leaf = _v1_tree(tmp_path)
    _write(Path(proc) / "self" / "cgroup", "4:cpu,cpuacct:/\n")
    h = HostSampler(every_s=0.0, proc=proc, cgroup_root=sys_cg)
    assert h.cgroup is not None and len(h.cgroup.dirs) == 1
    _write(Path(proc) / "self" / "cgroup", f"4:cpu,cpuacct:{V1_JOB}\n")
    assert "host_throttled" in h.sample()  # the root's counter still compares
    assert h.cgroup.dirs[0] == str(leaf)
    h._thr = (h._thr[0] - 1.0, h._thr[1])
    _v1_dir(leaf, thr_ns=2_900_000_000)  # 0.9 s more than the 2 s before
    assert h.sample()["host_throttled"] == pytest.approx(0.9, rel=0.05)
