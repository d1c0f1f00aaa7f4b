"""Cluster resolvers: a :class:`~pstrain.cluster.ClusterSpec` from where the deployment
keeps it. :class:`SimpleClusterResolver` from a value, :class:`TFConfigClusterResolver`
from the ``TF_CONFIG`` JSON that TensorFlow and Kubeflow's TFJob use (``PSTRAIN_CONFIG``
has the same form and wins), :class:`SlurmClusterResolver` from SLURM's environment. This
module is one of the two places that read the environment (the other is the CLI);
everything below receives values.
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from .cluster import KNOWN_JOBS, ClusterSpec, validate_ps_cluster
from .errors import InvalidArgumentError
from .exports import expose

__all__ = [
    "ClusterResolver",
    "RunningCluster",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
]


class ClusterResolver:
    """Base of the resolvers: a cluster spec, this process's task, a token."""

    task_type: str | None
    task_id: int | None
    token: str | None
    rpc_layer: str = "http"

    def cluster_spec(self) -> ClusterSpec:
        """The cluster's tasks and their addresses, as a :class:`ClusterSpec`."""
        raise NotImplementedError  # pragma: no cover - abstract

    def _check_task(self, spec: ClusterSpec) -> None:
        if self.task_type is None:
            return
        if self.task_type not in KNOWN_JOBS:
            raise InvalidArgumentError(f"Unrecognized task_type: {self.task_type}")
        if self.task_id is not None and not 0 <= self.task_id < max(spec.num_tasks(self.task_type), 1):
            raise InvalidArgumentError(
                f"task index {self.task_id} out of range for job {self.task_type!r} "
                f"with {spec.num_tasks(self.task_type)} task(s)"
            )


class SimpleClusterResolver(ClusterResolver):
    """A resolver for a spec you already have.

    >>> r = SimpleClusterResolver(ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}))
    >>> r.cluster_spec().num_tasks("worker")
    1
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        task_type: str | None = None,
        task_id: int | None = None,
        token: str | None = None,
    ) -> None:
        self._spec = ClusterSpec(cluster_spec)
        self.task_type = task_type
        self.task_id = task_id
        self.token = token
        self._check_task(self._spec)

    def cluster_spec(self) -> ClusterSpec:
        """The :class:`ClusterSpec` this resolver was given."""
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
        config = read_config(None, env)
        if config is None:
            raise InvalidArgumentError(
                "no cluster configuration: set PSTRAIN_CONFIG or TF_CONFIG to the JSON "
                '{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": ..., "index": ...}}'
            )
        self._spec = config[0]
        self.task_type, self.task_id = config[1], config[2]
        self.token = token if token is not None else read_token(env)
        self._check_task(self._spec)

    def cluster_spec(self) -> ClusterSpec:
        """The ``cluster`` of ``TF_CONFIG`` (or ``PSTRAIN_CONFIG``), as a :class:`ClusterSpec`."""
        return self._spec


def read_text(path: str, what: str) -> str:
    """The text of the file ``path`` that ``what`` (a flag or a variable) names, or
    InvalidArgumentError saying which file could not be read and why."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidArgumentError(f"{what} {path}: the file cannot be read ({why})") from None


def read_config(
    path: str | None, env: Mapping[str, str]
) -> tuple[ClusterSpec, str | None, int | None] | None:
    """A task's cluster configuration, parsed: the file ``path`` (``--cluster``), else
    ``PSTRAIN_CONFIG``, else ``TF_CONFIG``; None when there is none."""
    if path:
        return parse_config(read_text(path, "--cluster"), path)
    for source in ("PSTRAIN_CONFIG", "TF_CONFIG"):
        if env.get(source):
            return parse_config(env[source], source)
    return None


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
                'Give the JSON {"cluster": ...} itself, or the path of a file holding it'
            ) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = (
            (
                " (it looks like a file path: TF_CONFIG must hold the JSON itself; "
                "PSTRAIN_CONFIG may name a file)"
            )
            if source == "TF_CONFIG" and not stripped.startswith("{")
            else ""
        )
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
                f"with {spec.num_tasks(task_type)} task(s)"
            )
    return spec, task_type, task_id


def read_token(env: Mapping[str, str], path: str | None = None) -> str | None:
    """The cluster token from the file ``path`` (``--token-file``), else ``PSTRAIN_TOKEN``,
    else ``PSTRAIN_TOKEN_FILE``."""
    if path:
        return read_text(path, "--token-file").strip()
    if env.get("PSTRAIN_TOKEN"):
        return env["PSTRAIN_TOKEN"]
    path = env.get("PSTRAIN_TOKEN_FILE")
    if path:
        return read_text(path, "PSTRAIN_TOKEN_FILE").strip()
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
        m = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
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

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        environ: Mapping[str, str] | None = None,
        token: str | None = None,
    ) -> None:
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
                f"the step has {num_tasks}"
            )
        placed = sorted(zip(hosts, counts), key=lambda hc: _natural(hc[0]))
        addresses = [f"{host}:{port_base + i}" for host, n in placed for i in range(n)]
        node = env.get("SLURMD_NODENAME")
        if node and 0 <= rank < len(addresses) and addresses[rank].rsplit(":", 1)[0] != node:
            raise InvalidArgumentError(
                f"SLURM runs rank {rank} on {node}, but laying the step's tasks out node by node "
                f"({nodelist}, {per_node} tasks each) puts it on {addresses[rank].rsplit(':', 1)[0]}: "
                "run the step with block distribution (srun --distribution=block, the default)"
            )
        cluster: dict[str, list[str]] = {}
        start = 0
        self.task_type, self.task_id = None, None
        for job, n in sorted(jobs.items()):
            cluster[job] = addresses[start : start + n]
            if start <= rank < start + n:
                self.task_type, self.task_id = job, rank - start
            start += n
        self._spec = ClusterSpec(cluster)
        self.token = token if token is not None else read_token(env)
        self.rank = rank

    def cluster_spec(self) -> ClusterSpec:
        """The tasks of this SLURM step (from its nodes and the jobs given), as a :class:`ClusterSpec`."""
        return self._spec


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
        return SimpleClusterResolver(self.cluster_spec, task_type="chief", task_id=0, token=self.token)

    def config(self) -> dict[str, Any]:
        """The cluster as PSTRAIN_CONFIG / TF_CONFIG JSON for the coordinator."""
        return {"cluster": self.cluster_spec.as_dict(), "task": {"type": "chief", "index": 0}}


expose(globals(), "pstrain.cluster")
