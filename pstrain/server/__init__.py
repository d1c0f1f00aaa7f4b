"""Servers: one process serves one task of the cluster.

``Server(cluster_spec, job_name, task_index)`` builds the server for that
task (a :class:`~pstrain.server.ps.ParameterServer` for ``ps``, a
:class:`~pstrain.server.worker.WorkerServer` for ``worker``) listening on the
port the spec gives it, or on ``port`` (0 picks a free one).

::

    server = Server(spec, "ps", 0, port=0, token="s3cret")
    address = await server.start()
    ...
    await server.stop()

``config.py`` holds :class:`~pstrain.server.config.ServeConfig`, what a task is started with
(``Server(config)``; ``pstrain serve`` builds it from its flags and environment).

The package: ``ps/`` (the parameter server: ``ps/handlers.py`` its operations,
``ps/store.py`` its variables, ``ps/tables/`` its dynamic tables, ``ps/checkpoints/`` its
saves, deltas and serving feed, ``ps/moves/`` moves between ps) and ``worker/`` (the
worker: ``worker/executor.py`` its routes and resources, ``worker/runner.py`` where closures
run and how their results come back, ``worker/closures.py`` the runner's parts). What
every server shares (the handler table and its one reply path, the lifecycle, the
HTTP transport) is ``_serving/`` (``core.py``, ``base.py``, ``http.py``), below both; the
stream's listening end is ``_transport/listener.py``, beside its client end.
"""

from __future__ import annotations

import importlib
import socket
import ssl as ssl_module
from typing import TYPE_CHECKING, Any

from .._base.cluster import ClusterSpec, parse_address
from .._base.errors import InvalidArgumentError, PstrainError
from .._transport.frames import DEFAULT_MAX_BODY
from .config import ServeConfig, client_ssl

if TYPE_CHECKING:
    from .._serving.base import ServerBase
    from .._serving.core import Status
    from .ps.handlers import ParameterServer
    from .worker.executor import WorkerServer

__all__ = ["ParameterServer", "Server", "ServerBase", "Status", "WorkerServer"]

#: The servers' own classes and where they live, imported when first named: ``pstrain
#: serve``'s flags (``config.py``) and the CLI's commands that serve nothing (``--help``, a
#: flag given wrong, ``status``, ``launch``'s own process) do not load the servers' stack
#: (aiohttp, numpy and the handlers: 0.35 s of a 0.6 s ``pstrain serve --port x``).
_LAZY = {
    "ParameterServer": ".ps.handlers",
    "ServerBase": ".._serving.base",
    "Status": ".._serving.core",
    "WorkerServer": ".worker.executor",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Server:
    """The server of task ``job_name:task_index`` of ``cluster_spec``, or of the task a
    :class:`~pstrain.server.config.ServeConfig` describes (``Server(config)``: what
    ``pstrain serve`` builds from its flags and environment).

    ``await start()`` binds and returns the address, ``await join()`` waits
    until it stops, ``await stop()`` stops it.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | dict[str, Any] | ServeConfig,
        job_name: str | None = None,
        task_index: int | None = None,
        port: int | None = None,
        token: str | None = None,
        *,
        host: str | None = None,
        ssl_context: ssl_module.SSLContext | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        protocol: str | None = None,
        **options: Any,
    ) -> None:
        if protocol not in (None, "grpc", "pstrain"):
            raise InvalidArgumentError(
                f"unknown protocol {protocol!r}: pstrain servers speak their "
                "own stream and HTTP (TF's 'grpc' is accepted and ignored)"
            )
        if isinstance(cluster_spec, ServeConfig):
            given = [job_name, task_index, port, token, host, ssl_context, *options.values()]
            if any(v is not None for v in given) or max_body != DEFAULT_MAX_BODY:
                raise InvalidArgumentError("Server(config) takes the ServeConfig alone: it has everything")
            self._from_config(cluster_spec)
            return
        if job_name is None or task_index is None:
            raise InvalidArgumentError("Server(cluster_spec, job_name, task_index): give the task")
        spec = ClusterSpec(cluster_spec)
        spec_host, spec_port = parse_address(spec.task_address(job_name, task_index))
        kwargs: dict[str, Any] = dict(
            host=host if host is not None else "127.0.0.1",
            port=spec_port if port is None else port,
            token=token,
            ssl_context=ssl_context,
            max_body=max_body,
        )
        # (each role imports its own server only: a worker has no use for the ps's
        # operations, about 40 ms of CPU to import)
        self.impl: ServerBase
        if job_name == "ps":
            from .ps.handlers import ParameterServer

            self.impl = ParameterServer(task_index, **kwargs, **options)
        elif job_name == "worker":
            from .worker.executor import WorkerServer

            self.impl = WorkerServer(task_index, cluster_spec=spec, **kwargs, **options)
        else:
            raise InvalidArgumentError(
                f"no server for job {job_name!r}: 'pstrain serve' runs ps and worker tasks "
                "(the chief runs your script; the evaluator runs SidecarEvaluator)"
            )
        self.cluster_spec: ClusterSpec | None = spec
        self.job_name = job_name
        self.task_index = task_index

    def _from_config(self, config: ServeConfig) -> None:
        if config.role == "ps":
            from .ps.handlers import ParameterServer

            self.impl = ParameterServer(
                config.index,
                client_ssl=client_ssl(config.tls_ca),
                **config.server_options(),
                **config.ps.options(),
            )
        elif config.role == "worker":
            from .worker.executor import WorkerServer

            self.impl = WorkerServer(
                config.index,
                cluster_spec=config.spec,
                client_ssl=client_ssl(config.tls_ca),
                closure_threads=config.closure_threads,
                **config.server_options(),
            )
        else:
            raise InvalidArgumentError(f"no server for role {config.role!r} (ps and worker have one)")
        if config.listen_fd is not None:
            try:
                self.impl.bound = socket.socket(fileno=config.listen_fd)
            except OSError as exc:
                raise PstrainError(f"--listen-fd {config.listen_fd}: not a socket: {exc}") from None
        self.cluster_spec = config.spec
        self.job_name = config.role
        self.task_index = config.index

    @property
    def address(self) -> str | None:
        """``host:port`` it listens on, once started (None before)."""
        return self.impl.address

    @property
    def status(self) -> Status:
        """Where the server is in its life: ``Status.INIT``, ``RUNNING``, ``CLOSING`` or ``CLOSED``."""
        return self.impl.status

    async def start(self) -> str:
        """Start listening; returns the address (``host:port``)."""
        return await self.impl.start()

    async def join(self) -> None:
        """Wait until the server stops (TF's ``server.join()``)."""
        await self.impl.join()

    async def stop(self) -> None:
        """Stop serving and close its connections."""
        await self.impl.stop()
