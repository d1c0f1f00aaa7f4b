"""Cluster configuration: who the tasks are and where they listen.

A :class:`ClusterSpec` maps job names (``chief``, ``ps``, ``worker``,
``evaluator``) to task addresses. Resolvers build one from where the
deployment keeps it: :class:`SimpleClusterResolver` from a value,
:class:`TFConfigClusterResolver` from the ``TF_CONFIG`` JSON that TensorFlow
and Kubeflow's TFJob use (``PSTRAIN_CONFIG`` has the same form and wins).
This module is one of the two places that read the environment (the other is
``cli.py``); everything below receives values.
"""

from __future__ import annotations

import abc
import ipaddress
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidArgumentError, PstrainError
from .exports import expose

__all__ = [
    "LINK_DEADLINE_S",
    "ClusterResolver",
    "ClusterSpec",
    "RunningCluster",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
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


class RunningCluster(abc.ABC):
    """What a coordinator needs from a cluster it started (LocalCluster, InProcessCluster)."""

    token: str

    @property
    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The addresses of the cluster's tasks."""

    @property
    def resolver(self) -> SimpleClusterResolver:
        """A resolver for the coordinator (task ``chief:0``), carrying the token."""
        return SimpleClusterResolver(self.cluster_spec, task_type="chief", task_id=0,
                                     token=self.token)

    def config(self) -> dict[str, Any]:
        """The cluster as PSTRAIN_CONFIG / TF_CONFIG JSON for the coordinator."""
        return {"cluster": self.cluster_spec.as_dict(), "task": {"type": "chief", "index": 0}}


def listening_socket(host: str, port: int, what: str, backlog: int = 1024) -> socket.socket:
    """A non-blocking socket bound to ``host:port`` and listening (port 0 picks one).

    Bound before anyone is told the address: ready means listening.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PstrainError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


#: A connection whose sent data stays unacknowledged this long, or whose idle peer stops
#: answering keep-alive probes for about this long, fails (a partition, a dead host).
LINK_DEADLINE_S = 5.0


def tune_connection(sock: socket.socket | None, deadline_s: float = LINK_DEADLINE_S) -> None:
    """Give a TCP connection deadlines: keep-alive probes when idle and ``TCP_USER_TIMEOUT``
    when data is unacknowledged, so a partitioned peer is noticed in ``deadline_s``, not
    after the kernel's retransmission back-off (minutes)."""
    if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                              socket.AF_INET6):
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
            f"malformed address {address!r}: expected 'host:port', e.g. '127.0.0.1:2222'")
    host, _, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidArgumentError(
            f"malformed address {address!r}: expected 'host:port' with a port in 0..65535")
    if not _valid_host(host):
        raise InvalidArgumentError(
            f"malformed address {address!r}: the host must be a host name (letters, digits, "
            "'-' and '.', as DNS allows) or an IP address")
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
                f"cluster must be a mapping of job name to addresses, got {type(cluster).__name__}")
        jobs: dict[str, list[str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise InvalidArgumentError(f"job names must be non-empty strings, got {job!r}")
            if isinstance(tasks, Mapping):
                indices = sorted(int(i) for i in tasks)
                if indices != list(range(len(indices))):
                    raise InvalidArgumentError(
                        f"job {job!r} has task indices {indices}; they must be 0..N-1")
                addresses = [tasks[i] if i in tasks else tasks[str(i)] for i in indices]  # type: ignore[index]
            elif isinstance(tasks, (list, tuple)):
                addresses = list(tasks)
            else:
                raise InvalidArgumentError(
                    f"job {job!r} must list its task addresses, got {type(tasks).__name__}")
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
                f"task index {index} out of range for job {job!r} with {len(tasks)} task(s)")
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
            f"Disallowed task type found in cluster: {unknown}; allowed: {list(KNOWN_JOBS)}")
    if spec.num_tasks("chief") > 1:
        raise InvalidArgumentError("There must be at most one 'chief' job.")
    if spec.num_tasks("worker") < 1:
        raise InvalidArgumentError("There must be at least one worker.")
    if spec.num_tasks("ps") < 1:
        raise InvalidArgumentError("There must be at least one ps.")


class ClusterResolver:
    """Base of the resolvers: a cluster spec, this process's task, a token."""

    task_type: str | None
    task_id: int | None
    token: str | None
    rpc_layer: str = "http"

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError  # pragma: no cover - abstract

    def _check_task(self, spec: ClusterSpec) -> None:
        if self.task_type is None:
            return
        if self.task_type not in KNOWN_JOBS:
            raise InvalidArgumentError(f"Unrecognized task_type: {self.task_type}")
        if self.task_id is not None and not 0 <= self.task_id < max(spec.num_tasks(self.task_type), 1):
            raise InvalidArgumentError(
                f"task index {self.task_id} out of range for job {self.task_type!r} "
                f"with {spec.num_tasks(self.task_type)} task(s)")


class SimpleClusterResolver(ClusterResolver):
    """A resolver for a spec you already have.

    >>> r = SimpleClusterResolver(ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}))
    >>> r.cluster_spec().num_tasks("worker")
    1
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Any], task_type: str | None = None,
                 task_id: int | None = None, token: str | None = None) -> None:
        self._spec = ClusterSpec(cluster_spec)
        self.task_type = task_type
        self.task_id = task_id
        self.token = token
        self._check_task(self._spec)

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster from ``PSTRAIN_CONFIG`` or else ``TF_CONFIG``.

    The JSON is TensorFlow's::

        {"cluster": {"chief": ["host0:2222"], "ps": ["host1:2222"],
                     "worker": ["host2:2222", "host3:2222"]},
         "task": {"type": "worker", "index": 1}}

    The token comes from ``PSTRAIN_TOKEN`` (or the file named by
    ``PSTRAIN_TOKEN_FILE``) unless given.

    >>> import os, json
    >>> os.environ["TF_CONFIG"] = json.dumps({"cluster": {"ps": ["127.0.0.1:1"],
    ...     "worker": ["127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}})
    >>> TFConfigClusterResolver().task_type
    'worker'
    >>> del os.environ["TF_CONFIG"]
    """

    def __init__(self, environ: Mapping[str, str] | None = None, token: str | None = None) -> None:
        env = os.environ if environ is None else environ
        source = "PSTRAIN_CONFIG" if env.get("PSTRAIN_CONFIG") else "TF_CONFIG"
        text = env.get(source)
        if not text:
            raise InvalidArgumentError(
                "no cluster configuration: set PSTRAIN_CONFIG or TF_CONFIG to the JSON "
                '{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": ..., "index": ...}}')
        config = parse_config(text, source)
        self._spec = config[0]
        self.task_type, self.task_id = config[1], config[2]
        self.token = token if token is not None else read_token(env)
        self._check_task(self._spec)

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


def parse_config(text: str, source: str = "config") -> tuple[ClusterSpec, str | None, int | None]:
    """Parse TF_CONFIG-style JSON into (spec, task type, task index), validated.

    ``PSTRAIN_CONFIG`` may also name a file holding that JSON (TF_CONFIG may not: TF
    reads it as JSON only)."""
    stripped = text.strip()
    if source == "PSTRAIN_CONFIG" and stripped and not stripped.startswith("{"):
        try:
            with open(stripped, encoding="utf-8") as f:
                text, source = f.read(), f"PSTRAIN_CONFIG file {stripped}"
        except OSError as exc:
            raise InvalidArgumentError(
                f"PSTRAIN_CONFIG is neither JSON nor a readable file: {stripped!r} ({exc.strerror}). "
                'Give the JSON {"cluster": ...} itself, or the path of a file holding it') from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = (" (it looks like a file path: TF_CONFIG must hold the JSON itself; "
                "PSTRAIN_CONFIG may name a file)") if source == "TF_CONFIG" and not stripped.startswith("{") else ""
        raise InvalidArgumentError(f"{source} is not valid JSON: {exc}{hint}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise InvalidArgumentError(f"{source} must be a JSON object with a 'cluster' object")
    spec = ClusterSpec(config["cluster"])
    validate_ps_cluster(spec)
    task = config.get("task") or {}
    if not isinstance(task, dict):
        raise InvalidArgumentError(f"{source}: 'task' must be an object with 'type' and 'index'")
    task_type = task.get("type")
    task_id = task.get("index")
    if task_type is not None and task_type not in KNOWN_JOBS:
        raise InvalidArgumentError(f"Unrecognized task_type: {task_type}")
    if task_id is not None:
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise InvalidArgumentError(f"{source}: task index must be an integer, got {task_id!r}")
        if task_type is not None and not 0 <= task_id < max(spec.num_tasks(task_type), 1):
            raise InvalidArgumentError(
                f"{source}: task index {task_id} out of range for job {task_type!r} "
                f"with {spec.num_tasks(task_type)} task(s)")
    return spec, task_type, task_id


def read_token(env: Mapping[str, str]) -> str | None:
    """The cluster token from ``PSTRAIN_TOKEN`` or ``PSTRAIN_TOKEN_FILE``."""
    if env.get("PSTRAIN_TOKEN"):
        return env["PSTRAIN_TOKEN"]
    path = env.get("PSTRAIN_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return None


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed host lists: ``node[001-003,7],gpu2`` -> node001 ... node7, gpu2.

    >>> expand_hostlist("n[01-03,7],x")
    ['n01', 'n02', 'n03', 'n7', 'x']
    """
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", hostlist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{part}{suffix}")
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (SLURM_STEP_TASKS_PER_NODE)."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise InvalidArgumentError(f"cannot parse SLURM tasks per node {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _natural(host: str) -> list[Any]:
    """Sort key that orders ``n9`` before ``n10``.

    >>> sorted(["n10", "n8", "n9"], key=_natural)
    ['n8', 'n9', 'n10']
    """
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", host) if t]


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a SLURM job step, with TensorFlow's rules.

    Hosts come from ``SLURM_STEP_NODELIST`` in SLURM's own order, which is
    numeric-aware (``n8, n9, n10``: the order in which SLURM gives out ranks;
    plain string order would put ``n10`` first and send every rank to another
    task's address), each running
    ``SLURM_STEP_TASKS_PER_NODE`` tasks on ports ``port_base``,
    ``port_base + 1``, ...; the resulting addresses are dealt to the jobs in
    sorted job-name order (``chief``, ``ps``, ``worker``); this process's task
    is the one at rank ``SLURM_PROCID``.

    >>> env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
    ...        "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    >>> r = SlurmClusterResolver(jobs={"ps": 1, "worker": 3}, port_base=8888, environ=env)
    >>> r.task_type, r.task_id, r.cluster_spec().task_address("worker", 0)
    ('worker', 0, 'n1:8889')
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = 8888,
                 environ: Mapping[str, str] | None = None, token: str | None = None) -> None:
        env = os.environ if environ is None else environ
        try:
            rank = int(env["SLURM_PROCID"])
            num_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
            nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"]
        except KeyError as exc:
            raise InvalidArgumentError(f"not inside a SLURM job step: {exc.args[0]} is not set") from None
        hosts = expand_hostlist(nodelist)
        counts = expand_tasks_per_node(per_node)
        if len(counts) != len(hosts):
            raise InvalidArgumentError(f"SLURM lists {len(hosts)} nodes but tasks for {len(counts)}")
        jobs = dict(jobs or {"worker": num_tasks})
        if sum(jobs.values()) > num_tasks:
            raise InvalidArgumentError(
                f"Requested more tasks than assigned tasks: jobs {jobs} need {sum(jobs.values())}, "
                f"the step has {num_tasks}")
        placed = sorted(zip(hosts, counts), key=lambda hc: _natural(hc[0]))
        addresses = [f"{host}:{port_base + i}" for host, n in placed for i in range(n)]
        node = env.get("SLURMD_NODENAME")
        if node and 0 <= rank < len(addresses) and addresses[rank].rsplit(":", 1)[0] != node:
            raise InvalidArgumentError(
                f"SLURM runs rank {rank} on {node}, but laying the step's tasks out node by node "
                f"({nodelist}, {per_node} tasks each) puts it on {addresses[rank].rsplit(':', 1)[0]}: "
                "run the step with block distribution (srun --distribution=block, the default)")
        cluster: dict[str, list[str]] = {}
        start = 0
        self.task_type, self.task_id = None, None
        for job, n in sorted(jobs.items()):
            cluster[job] = addresses[start:start + n]
            if start <= rank < start + n:
                self.task_type, self.task_id = job, rank - start
            start += n
        self._spec = ClusterSpec(cluster)
        self.token = token if token is not None else read_token(env)
        self.rank = rank

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


expose(globals(), "pstrain.cluster")
