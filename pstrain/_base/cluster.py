"""Cluster configuration: who the tasks are and where they listen.

A :class:`ClusterSpec` maps job names (``chief``, ``ps``, ``worker``,
``evaluator``) to task addresses; the resolvers that build one from where the
deployment keeps it are in ``resolvers.py``. Also here: task names, addresses and
the listening sockets every server binds.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Protocol

from .errors import InvalidArgumentError, PstrainError
from .exports import expose

__all__ = [
    "LINK_DEADLINE_S",
    "ClusterSpec",
    "is_loopback",
    "listening_socket",
    "parse_address",
    "tune_connection",
    "task_name",
]

#: Job names a parameter-server cluster may hold.
KNOWN_JOBS = ("chief", "evaluator", "ps", "worker")


def task_name(job: str, index: int) -> str:
    """The TF-style task name, e.g. ``/job:ps/replica:0/task:1``."""
    return f"/job:{job}/replica:0/task:{index}"


class Named(Protocol):
    """What knows a task's name as it is now: a server (a ps that joined a job takes the
    index its coordinator gives it, and every part of it answers as that one)."""

    @property
    def task(self) -> str: ...

    @property
    def index(self) -> int: ...


class FixedName:
    """A name that does not change: a part built on its own (a tool, a test).

    >>> FixedName("/job:ps/replica:0/task:1").index
    1
    """

    def __init__(self, task: str) -> None:
        self.task = task
        self.index = int(task.rsplit(":", 1)[1]) if task.rsplit(":", 1)[-1].isdigit() else 0


def named(who: str | Named) -> Named:
    """``who`` as a :class:`Named`: a task name as a fixed one."""
    return FixedName(who) if isinstance(who, str) else who


def is_loopback(host: str) -> bool:
    """Is ``host`` a loopback address (``localhost``, 127.0.0.0/8, ``::1``)?

    >>> is_loopback("127.0.0.2"), is_loopback("0.0.0.0"), is_loopback("localhost")
    (True, False, True)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Set to ``0`` to keep same-host connections on loopback TCP (both ends read it).
LOCAL_SOCKETS_ENV = "PSTRAIN_LOCAL_SOCKETS"


def local_socket_name(host: str, port: int) -> str | None:
    """The abstract Unix socket a server listening on loopback ``host:port`` also listens
    on, and a client dialling that address connects to first; None for any other address,
    or when ``PSTRAIN_LOCAL_SOCKETS=0``.

    Loopback TCP runs every byte through the TCP/IP stack twice, once per end; a Unix
    socket copies it once (W8 sends 4 MB a step over loopback). The name is in Linux's
    abstract namespace, which belongs to the network namespace as ``127.0.0.1`` does: a
    client reaches the same server either way, and the cluster's handshake still
    authenticates both ends.

    >>> local_socket_name("127.0.0.1", 2222)
    '\\x00pstrain:127.0.0.1:2222'
    >>> local_socket_name("10.0.0.2", 2222) is None
    True
    """
    if os.environ.get(LOCAL_SOCKETS_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return None  # (abstract names are Linux's)
    if not port or not is_loopback(host):
        return None
    ip = "127.0.0.1" if host == "localhost" else str(ipaddress.ip_address(host))
    return f"\0pstrain:{ip}:{port}"


#: The send buffer asked for a local socket (the kernel caps it at ``net.core.wmem_max``):
#: a step's request is megabytes, and a small buffer splits it into many wake-ups.
LOCAL_SOCKET_BUFFER = 4 << 20


def _local_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, LOCAL_SOCKET_BUFFER)
    return sock


def local_listener(name: str, backlog: int = 1024) -> socket.socket | None:
    """A non-blocking Unix socket listening on ``name``, or None if the name is taken."""
    sock = _local_socket()
    try:
        sock.bind(name)
        sock.listen(backlog)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def local_connection(name: str) -> socket.socket | None:
    """A non-blocking Unix socket connected to ``name``, or None if nothing listens there
    (or its backlog is full: the caller dials TCP instead)."""
    sock = _local_socket()
    sock.setblocking(False)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        return None
    return sock


def listening_socket(
    host: str, port: int, what: str, backlog: int = 1024, bound: socket.socket | None = None
) -> socket.socket:
    """A non-blocking socket bound to ``host:port`` and listening (port 0 picks one).

    Bound before anyone is told the address: ready means listening. ``bound``: a socket
    already bound to ``host:port`` by the process that started this one (``LocalCluster``
    restarts a task on its port so), used if it is bound to exactly that address.
    """
    if bound is not None:
        _check_bound(bound, host, port, what)
        sock = bound
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # listens past TIME_WAITs
    else:
        sock = _bound(host, port, f"{what} cannot listen on {host}:{port}")
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def reserved_port(host: str, port: int, what: str) -> socket.socket:
    """A socket bound to ``host:port`` again (past the TIME_WAITs of one that listened
    there), not listening: no other process can bind the port while it is held, and a
    connection is refused, until a process it is handed to listens on it
    (:func:`listening_socket` ``bound=``)."""
    sock = _bound(host, port, f"{what} cannot start again on its port {port} (another process took it?)")
    # and then not: Linux lets any number of bound sockets that are not listening share a
    # port if all of them allow it (the process it is handed to allows it again)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    return sock


def _bound(host: str, port: int, failed: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``: past the TIME_WAITs of one that
    listened there), or PstrainError saying ``failed`` and why."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PstrainError(f"{failed}: {exc.strerror or exc}") from exc
    return sock


def _check_bound(sock: socket.socket, host: str, port: int, what: str) -> None:
    """PstrainError unless ``sock`` is a TCP socket bound to ``host:port`` (its address,
    not only its port: a socket bound to all interfaces must not pass for a loopback one)."""
    try:
        got = sock.getsockname()
        family, kind = sock.family, sock.type
    except OSError as exc:
        raise PstrainError(f"{what}: the socket handed over is not usable: {exc}") from None
    try:
        want = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        raise PstrainError(
            f"{what}: a socket handed over needs the host as an address, not {host!r}"
        ) from None
    if (
        kind != socket.SOCK_STREAM
        or family not in (socket.AF_INET, socket.AF_INET6)
        or ipaddress.ip_address(got[0]) != want
        or (port and got[1] != port)
        or not got[1]
    ):
        raise PstrainError(
            f"{what}: the socket handed over is bound to {got!r}, not to {host}:{port or '(a port)'}"
        )


#: A connection whose sent data stays unacknowledged this long, or whose idle peer stops
#: answering keep-alive probes for about this long, fails (a partition, a dead host).
LINK_DEADLINE_S = 5.0


def tune_connection(sock: socket.socket | None, deadline_s: float = LINK_DEADLINE_S) -> None:
    """Give a TCP connection deadlines: keep-alive probes when idle and ``TCP_USER_TIMEOUT``
    when data is unacknowledged, so a partitioned peer is noticed in ``deadline_s``, not
    after the kernel's retransmission back-off (minutes)."""
    if (
        sock is None
        or sock.type != socket.SOCK_STREAM
        or sock.family not in (socket.AF_INET, socket.AF_INET6)
    ):
        return
    probes = 3
    idle = max(1, int(deadline_s) - probes)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(deadline_s * 1000))
    except OSError:  # pragma: no cover - an exotic socket: keep the kernel's defaults
        pass


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) or raise InvalidArgumentError.

    >>> parse_address("127.0.0.1:8470")
    ('127.0.0.1', 8470)
    """
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgumentError(
            f"malformed address {address!r}: expected 'host:port', e.g. '127.0.0.1:2222'"
        )
    host, _, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidArgumentError(
            f"malformed address {address!r}: expected 'host:port' with a port in 0..65535"
        )
    if not _valid_host(host):
        raise InvalidArgumentError(
            f"malformed address {address!r}: the host must be a host name (letters, digits, "
            "'-' and '.', as DNS allows) or an IP address"
        )
    return host, int(port_text)


_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _valid_host(host: str) -> bool:
    """A DNS host name (RFC 1123 labels; '_' allowed, as some resolvers do) or an IP literal:
    whatever else enters as an address (markup, spaces, paths) is refused where it enters."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


class ClusterSpec:
    """The tasks of a cluster, by job.

    >>> spec = ClusterSpec({"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]})
    >>> spec.num_tasks("ps"), spec.task_address("worker", 0)
    (1, '127.0.0.1:2223')
    """

    def __init__(self, cluster: Mapping[str, Sequence[str] | Mapping[int, str]] | ClusterSpec) -> None:
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, Mapping):
            raise InvalidArgumentError(
                f"cluster must be a mapping of job name to addresses, got {type(cluster).__name__}"
            )
        jobs: dict[str, list[str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise InvalidArgumentError(f"job names must be non-empty strings, got {job!r}")
            if isinstance(tasks, Mapping):
                indices = sorted(int(i) for i in tasks)
                if indices != list(range(len(indices))):
                    raise InvalidArgumentError(f"job {job!r} has task indices {indices}; they must be 0..N-1")
                addresses = [tasks[i] if i in tasks else tasks[str(i)] for i in indices]  # type: ignore[index]
            elif isinstance(tasks, (list, tuple)):
                addresses = list(tasks)
            else:
                raise InvalidArgumentError(
                    f"job {job!r} must list its task addresses, got {type(tasks).__name__}"
                )
            for address in addresses:
                parse_address(address)
            jobs[job] = addresses
        self._jobs = jobs

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def num_tasks(self, job: str) -> int:
        """How many tasks ``job`` has (0 for a job not in the cluster)."""
        return len(self._jobs.get(job, ()))

    def task_address(self, job: str, index: int) -> str:
        """The ``host:port`` of task ``index`` of ``job``."""
        tasks = self._jobs.get(job)
        if tasks is None:
            raise InvalidArgumentError(f"no job {job!r} in the cluster (jobs: {self.jobs})")
        if not 0 <= index < len(tasks):
            raise InvalidArgumentError(
                f"task index {index} out of range for job {job!r} with {len(tasks)} task(s)"
            )
        return tasks[index]

    def job_tasks(self, job: str) -> list[str]:
        """The addresses of every task of ``job``, in index order."""
        return list(self._jobs.get(job, ()))

    def as_dict(self) -> dict[str, list[str]]:
        """A plain dict ``{job: [address, ...]}`` (JSON-ready)."""
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and other._jobs == self._jobs

    def __repr__(self) -> str:
        return f"ClusterSpec({self._jobs!r})"


def validate_ps_cluster(spec: ClusterSpec) -> None:
    """Check the shape a parameter-server cluster needs (TF's rules and wording)."""
    unknown = [job for job in spec.jobs if job not in KNOWN_JOBS]
    if unknown:
        raise InvalidArgumentError(
            f"Disallowed task type found in cluster: {unknown}; allowed: {list(KNOWN_JOBS)}"
        )
    if spec.num_tasks("chief") > 1:
        raise InvalidArgumentError("There must be at most one 'chief' job.")
    if spec.num_tasks("worker") < 1:
        raise InvalidArgumentError("There must be at least one worker.")
    if spec.num_tasks("ps") < 1:
        raise InvalidArgumentError("There must be at least one ps.")


expose(globals(), "pstrain.cluster")
