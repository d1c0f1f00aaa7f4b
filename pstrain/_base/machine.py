"""What this process may use of the machine it runs on: its memory and its cores.

A process in a container (Kubernetes, Docker), a SLURM job or a systemd unit may use less
than the machine has. Its memory: the kernel kills it (the OOM killer, SIGKILL) once its
cgroup holds more than the cgroup's limit, so defaults reckoned from the machine's RAM let
a ps take what it may not hold, and die where it should have refused. Its cores: a cpuset
(the cores it may run on: SLURM's allocation, ``docker --cpuset-cpus``) and a CPU quota
(``docker --cpus``, a pod's CPU limit: so much CPU time a period, however many cores
run it). Sizing thread pools for every core of the machine runs many times the threads
the process may keep busy, and a quota throttles them all once it is spent.

Both are read as the kernel applies them: the lowest limit of the process's cgroup and of
every cgroup above it that the process can see, in cgroup v2 (``memory.max``,
``cpu.max``) or v1 (``memory.limit_in_bytes``, ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``).
"""

from __future__ import annotations

import os

__all__ = ["memory_limit", "physical_memory", "resident_memory", "usable_cores"]


def physical_memory() -> int | None:
    """The machine's RAM in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not on Linux
        return None


def resident_memory() -> int:
    """This process's resident memory now, in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def memory_limit(proc: str = "/proc/self") -> tuple[int, str] | None:
    """The bytes of memory this process may use and what sets them (``"the machine's RAM"``,
    or ``"its cgroup's memory limit"`` when that is lower); None where neither is known.
    (``proc``: where the process's ``cgroup`` and ``mountinfo`` are read, for tests.)"""
    ram = physical_memory()
    limits = []
    for directory, v2 in _cgroups("memory", proc):
        limit = _number(os.path.join(directory, "memory.max" if v2 else "memory.limit_in_bytes"))
        if limit is not None:
            limits.append(limit)
    cgroup = min(limits, default=None)
    if cgroup is not None and (ram is None or cgroup < ram):
        return cgroup, "its cgroup's memory limit"
    return None if ram is None else (ram, "the machine's RAM")


def usable_cores(proc: str = "/proc/self") -> int:
    """How many cores this process can keep busy: those it may run on, fewer if its
    cgroups' CPU quota gives less time than that (a quota of 2.5 cores: 2). At least 1.
    (``proc``: as :func:`memory_limit`'s.)"""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    quotas = []
    for directory, v2 in _cgroups("cpu", proc):
        if v2:  # "<quota> <period>", or "max <period>"
            quota, period, *_ = (*_numbers(os.path.join(directory, "cpu.max")), None)
        else:
            quota = _number(os.path.join(directory, "cpu.cfs_quota_us"))
            period = _number(os.path.join(directory, "cpu.cfs_period_us"))
        if quota is not None and period:
            quotas.append(quota // period)
    return max(1, min([cores, *quotas]))


def _cgroups(controller: str, proc: str) -> list[tuple[str, bool]]:
    """The directories of this process's cgroup and of those above it that it can see, in
    each hierarchy with ``controller``: (directory, whether cgroup v2)."""
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            memberships = f.read().splitlines()
        with open(os.path.join(proc, "mountinfo")) as f:
            mounts = f.read().splitlines()
    except OSError:
        return []
    where: dict[bool, str] = {}  # the process's cgroup, by version
    for line in memberships:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            where[True] = path
        elif controller in controllers.split(","):
            where[False] = path
    found = []
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        parts, kinds = fields.split(), rest.split()
        if len(parts) < 5 or len(kinds) < 3:
            continue
        if kinds[0] == "cgroup2":
            v2 = True
        elif kinds[0] == "cgroup" and controller in kinds[2].split(","):
            v2 = False
        else:
            continue
        if v2 not in where:
            continue
        root, point, path = parts[3], parts[4], where[v2]
        # The cgroup as this mount shows it; a container's own mount shows its cgroup at
        # the mount point (``root``), and none of those above it.
        inside = os.path.relpath(path, root) if path.startswith(root) else "."
        directory = os.path.normpath(os.path.join(point, inside))
        while directory.startswith(point):
            found.append((directory, v2))
            if directory == point:
                break
            directory = os.path.dirname(directory)
    return found


def _numbers(path: str) -> tuple[int | None, ...]:
    """The numbers a cgroup file holds, side by side (``"max"`` or ``-1``, no limit: None);
    ``(None,)`` if it cannot be read."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return (None,)
    return tuple(int(w) if w.isdigit() else None for w in words) or (None,)


def _number(path: str) -> int | None:
    return _numbers(path)[0]
