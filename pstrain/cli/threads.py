"""How many threads a task's numeric libraries use: its share of the cores it may use.

Several tasks on one machine each sizing their BLAS, OpenMP, PyTorch and XLA pools for the
whole machine oversubscribe it (PyTorch closures ran 7x slower under a hand-started
``pstrain serve`` than under ``pstrain launch``, which sized them). ``pstrain serve`` and
``pstrain launch`` size them the same way, before those libraries load, unless the user
set them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping, Sequence

from .._base.cluster import ClusterSpec, is_loopback, parse_address
from .._base.errors import InvalidArgumentError, PstrainError
from .._base.machine import usable_cores
from .._base.resolvers import read_config

__all__ = [
    "THREAD_VARS",
    "cpu_list",
    "cpu_shares",
    "pin_serve",
    "presize_serve",
    "size_threads",
    "tasks_on_host",
    "threads_for",
]

#: What OpenBLAS, MKL, OpenMP and PyTorch (its intra-op pool) read at load.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def threads_for(tasks: int, cpus: int | None = None) -> int:
    """Each of ``tasks`` tasks' share of ``cpus`` cores (default: those this process can keep
    busy, :func:`~pstrain._base.machine.usable_cores`: not the machine's, in a cpuset or
    under a CPU quota), at least 1."""
    return max(1, (cpus or usable_cores()) // max(1, tasks))


def tasks_on_host(spec: ClusterSpec, role: str, index: int) -> int:
    """The ps and workers of ``spec`` on the host of task ``role:index`` (loopback
    addresses are one host), that task included."""

    def host(address: str) -> str:
        name = parse_address(address)[0]
        return "loopback" if is_loopback(name) else name

    try:
        mine = host(spec.task_address(role, index))
    except (PstrainError, IndexError, KeyError):
        return 1
    return max(1, sum(host(a) == mine for job in ("ps", "worker") for a in spec.job_tasks(job)))


def size_threads(env: MutableMapping[str, str], threads: int) -> dict[str, str]:
    """Set the thread variables to ``threads`` where the user has not set them; returns
    what was set. One thread per process also turns off XLA's multi-threaded Eigen."""
    chosen = {}
    for var in THREAD_VARS:
        if var not in env:
            env[var] = chosen[var] = str(threads)
    if threads == 1 and "xla_cpu_multi_thread_eigen" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = chosen["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
    return chosen


def _serve_flags(argv: Sequence[str]) -> argparse.Namespace | None:
    """The flags of ``pstrain serve ...`` read before its modules load (None: another
    command); the rest, and their errors, are serve's own parser's."""
    if not argv or argv[0] != "serve":
        return None
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--role")
    pre.add_argument("--index", type=int)
    pre.add_argument("--cluster")
    pre.add_argument("--cpus")
    known, _ = pre.parse_known_args(list(argv[1:]))
    return known


def cpu_list(text: str) -> list[int]:
    """The cores of ``text`` (``"0"``, ``"0-3"``, ``"0,2,4-5"``), each of them one this
    process may run on, ascending; InvalidArgumentError naming what is wrong otherwise."""
    allowed = os.sched_getaffinity(0)
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise InvalidArgumentError(f"{text!r} is not a list of cores (0-3,6, say)") from None
        if first < 0 or last < first:
            raise InvalidArgumentError(f"{part.strip()!r} in {text!r} is not a range of cores")
        cpus.update(range(first, last + 1))
    outside = sorted(cpus - allowed)
    if outside:
        raise InvalidArgumentError(
            f"cores {outside} are not among those this process may run on {sorted(allowed)}"
        )
    return sorted(cpus)


def cpu_shares(tasks: int, cpus: Sequence[int]) -> list[list[int]]:
    """Cores for each of ``tasks`` tasks of one machine: as many tasks as cores or more,
    task ``k`` on core ``k mod n`` (ps ``i`` beside worker ``i`` when the ps come first);
    fewer, each task its own run of ``n // tasks`` cores.

    >>> cpu_shares(4, [0, 1])
    [[0], [1], [0], [1]]
    >>> cpu_shares(2, [0, 1, 2, 3, 4])
    [[0, 1], [2, 3]]
    """
    n = len(cpus)
    if tasks >= n:
        return [[cpus[k % n]] for k in range(tasks)]
    each = n // tasks
    return [list(cpus[k * each : (k + 1) * each]) for k in range(tasks)]


def pin_serve(argv: Sequence[str]) -> str | None:
    """For ``pstrain serve --cpus LIST``: run this process (and every thread it starts
    later) on those cores, before any thread starts. Returns what to log; a list given
    wrong is left to the flag's own error."""
    known = _serve_flags(argv)
    if known is None or known.cpus is None:
        return None
    try:
        cpus = cpu_list(known.cpus)
    except InvalidArgumentError:
        return None  # serve's parser refuses it, naming the flag
    os.sched_setaffinity(0, cpus)
    return f"running on cores {known.cpus} (--cpus)"


def presize_serve(argv: Sequence[str], env: MutableMapping[str, str]) -> str | None:
    """For ``pstrain serve ...``: size the threads before numpy or PyTorch load (they read
    the variables once, at load). Returns what to log once logging is set up (None: the
    task has the machine to itself, or its cluster is not known yet)."""
    known = _serve_flags(argv)
    if known is None:
        return None
    try:
        config = read_config(known.cluster, env)
    except (OSError, PstrainError):
        return None  # serve reports it, with its own message
    if config is None:
        return None
    spec, task_type, task_id = config
    role = known.role or task_type
    index = known.index if known.index is not None else task_id or 0
    if role not in ("ps", "worker"):
        return None
    tasks, cores = tasks_on_host(spec, role, index), usable_cores()
    chosen = size_threads(env, threads_for(tasks, cores))
    if not chosen or tasks == 1:
        return None
    return (
        f"{tasks} tasks of the cluster share the {cores} cores this one may use: "
        f"{', '.join(f'{k}={v}' for k, v in chosen.items())} (set them to choose)"
    )
