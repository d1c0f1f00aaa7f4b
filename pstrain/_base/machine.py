"""What this process may use of the machine it runs on: its memory.

A process in a container (Kubernetes, Docker), a SLURM job or a systemd unit with
``MemoryMax`` may use less memory than the machine has: the kernel kills it (the OOM
killer, SIGKILL) once its cgroup holds more than the cgroup's limit. Defaults reckoned
from the machine's RAM alone let a ps take what it may not hold, and die where it should
have refused. The limit is read as the kernel applies it: the lowest ``memory.max``
(cgroup v2) or ``memory.limit_in_bytes`` (v1) of the process's cgroup and of every cgroup
above it that the process can see.
"""

from __future__ import annotations

import os

__all__ = ["memory_limit", "physical_memory"]


def physical_memory() -> int | None:
    """The machine's RAM in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not on Linux
        return None


def memory_limit() -> tuple[int, str] | None:
    """The bytes of memory this process may use and what sets them (``"the machine's RAM"``,
    or ``"its cgroup's memory limit"`` when that is lower); None where neither is known."""
    ram = physical_memory()
    cgroup = min(_cgroup_limits(), default=None)
    if cgroup is not None and (ram is None or cgroup < ram):
        return cgroup, "its cgroup's memory limit"
    return None if ram is None else (ram, "the machine's RAM")


def _cgroup_limits() -> list[int]:
    """The memory limits of this process's cgroup and those above it, in every hierarchy
    that has the memory controller (v2, or v1's ``memory``)."""
    try:
        with open("/proc/self/cgroup") as f:
            memberships = f.read().splitlines()
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return []
    where: dict[str, str] = {}  # the process's cgroup, by the kind of hierarchy
    for line in memberships:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            where["cgroup2"] = path
        elif "memory" in controllers.split(","):
            where["cgroup"] = path
    limits = []
    for mount in mounts:
        fields, _, rest = mount.partition(" - ")
        parts, kinds = fields.split(), rest.split()
        if len(parts) < 5 or len(kinds) < 3:
            continue
        kind, options = kinds[0], kinds[2].split(",")
        if kind == "cgroup2" and "cgroup2" in where:
            name, path = "memory.max", where["cgroup2"]
        elif kind == "cgroup" and "memory" in options and "cgroup" in where:
            name, path = "memory.limit_in_bytes", where["cgroup"]
        else:
            continue
        root, point = parts[3], parts[4]
        # The cgroup as this mount shows it; a container's own mount shows its cgroup at
        # the mount point (``root``), and none of those above it.
        inside = os.path.relpath(path, root) if path.startswith(root) else "."
        directory = os.path.normpath(os.path.join(point, inside))
        while directory.startswith(point):
            limit = _read_limit(os.path.join(directory, name))
            if limit is not None:
                limits.append(limit)
            if directory == point:
                break
            directory = os.path.dirname(directory)
    return limits


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # ("max": none)
