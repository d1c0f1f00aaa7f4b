"""What a process may use of its machine (``pstrain._base.machine``), read from cgroup file
systems laid out as the kernel lays them out: v1 and v2, a host's view (the process's
cgroup deep in the hierarchy, limits above it too) and a container's (its own cgroup at
the mount's root). The machine's own cgroups are tested on real processes in
``tests/processes/test_machine_limits.py``; this machine has v1's memory and cpu, so the
v2 layouts are files here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pstrain._base.machine import memory_limit, physical_memory, usable_cores

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def _layout(
    tmp_path: Path, cgroup: str, mounts: list[tuple[str, str, str, str]], files: dict[str, str]
) -> str:
    """A fake ``/proc/self`` (its ``cgroup``, and ``mountinfo`` of ``mounts``: (root, mount
    point under ``tmp_path``, fstype, super options)) and the cgroup files ``files`` (paths
    under ``tmp_path``); returns the fake ``/proc/self``."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    lines = [
        f"{30 + k} 23 0:{40 + k} {root} {tmp_path / point} rw,relatime - {kind} {kind} {options}"
        for k, (root, point, kind, options) in enumerate(mounts)
    ]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(proc)


def test_cgroup_v2_on_a_host_takes_the_lowest_limit_of_the_cgroup_and_those_above_it(tmp_path):
    proc = _layout(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        [("/", "cg", "cgroup2", "rw,nsdelegate")],
        {
            "cg/kubepods/memory.max": str(512 * MiB),  # the pod's: lower than the container's
            "cg/kubepods/pod1/memory.max": "max",
            "cg/kubepods/pod1/ctr/memory.max": str(1024 * MiB),
            "cg/kubepods/pod1/ctr/cpu.max": "250000 100000",  # 2.5 cores: 2
        },
    )
    assert memory_limit(proc) == (512 * MiB, "its cgroup's memory limit")
    assert usable_cores(proc) == min(2, len(os.sched_getaffinity(0)))


def test_cgroup_v2_in_a_container_reads_its_own_cgroup_at_the_mount_point(tmp_path):
    # A cgroup namespace: /proc/self/cgroup says "/", the mount's root is the container's.
    proc = _layout(
        tmp_path,
        "0::/\n",
        [("/", "cg", "cgroup2", "rw")],
        {"cg/memory.max": str(300 * MiB), "cg/cpu.max": "max 100000"},
    )
    assert memory_limit(proc) == (300 * MiB, "its cgroup's memory limit")
    assert usable_cores(proc) == len(os.sched_getaffinity(0))  # no quota


def test_cgroup_v1_mounted_at_the_containers_cgroup_and_unlimited_values(tmp_path):
    # Docker with cgroup v1: the mount's root is the container's cgroup, which the process's
    # path names in full; "unlimited" is the largest page-aligned number.
    proc = _layout(
        tmp_path,
        "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
        [
            ("/docker/abc", "memory", "cgroup", "rw,memory"),
            ("/docker/abc", "cpu", "cgroup", "rw,cpu,cpuacct"),
        ],
        {
            "memory/memory.limit_in_bytes": "9223372036854771712",
            "cpu/cpu.cfs_quota_us": "-1",
            "cpu/cpu.cfs_period_us": "100000",
        },
    )
    assert memory_limit(proc) == (physical_memory(), "the machine's RAM")
    assert usable_cores(proc) == len(os.sched_getaffinity(0))


def test_no_cgroups_to_read_is_the_machine(tmp_path):
    assert memory_limit(str(tmp_path / "nothing")) == (physical_memory(), "the machine's RAM")
    assert usable_cores(str(tmp_path / "nothing")) == len(os.sched_getaffinity(0))
