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

The package: ``ps/`` (the parameter server: ``ps/handlers.py`` its operations,
``ps/store.py`` its variables, ``ps/tables/`` its dynamic tables, ``ps/checkpoints/`` its
saves, deltas and serving feed, ``ps/moves/`` moves between ps) and ``worker/`` (the
worker: ``worker/executor.py`` its routes and resources, ``worker/runner.py`` where closures
run and how their results come back, ``worker/closures.py`` the runner's parts). What
every server shares (the handler table and its one reply path, the lifecycle, the
two transports) is ``_serving/`` (``core.py``, ``base.py``, ``http.py``,
``stream.py``), below both.
"""

from __future__ import annotations

import ssl as ssl_module
from typing import Any

from .._base.cluster import ClusterSpec, parse_address
from .._base.errors import InvalidArgumentError
from .._formats.codec.protocol import DEFAULT_MAX_BODY
from .._serving.base import ServerBase
from .._serving.core import Status
from .ps.handlers import ParameterServer
from .worker.executor import WorkerServer

__all__ = ["ParameterServer", "Server", "ServerBase", "Status", "WorkerServer"]


class Server:
    """The server of task ``job_name:task_index`` of ``cluster_spec``.

    ``await start()`` binds and returns the address, ``await join()`` waits
    until it stops, ``await stop()`` stops it.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | dict[str, Any],
        job_name: str,
        task_index: int,
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
        spec = ClusterSpec(cluster_spec)
        spec_host, spec_port = parse_address(spec.task_address(job_name, task_index))
        kwargs: dict[str, Any] = dict(
            host=host if host is not None else "127.0.0.1",
            port=spec_port if port is None else port,
            token=token,
            ssl_context=ssl_context,
            max_body=max_body,
        )
        self.impl: ServerBase
        if job_name == "ps":
            self.impl = ParameterServer(task_index, **kwargs, **options)
        elif job_name == "worker":
            self.impl = WorkerServer(task_index, cluster_spec=spec, **kwargs, **options)
        else:
            raise InvalidArgumentError(
                f"no server for job {job_name!r}: 'pstrain serve' runs ps and worker tasks "
                "(the chief runs your script; the evaluator runs SidecarEvaluator)"
            )
        self.cluster_spec = spec
        self.job_name = job_name
        self.task_index = task_index

    @property
    def address(self) -> str | None:
        return self.impl.address

    @property
    def status(self) -> Status:
        return self.impl.status

    async def start(self) -> str:
        return await self.impl.start()

    async def join(self) -> None:
        await self.impl.join()

    async def stop(self) -> None:
        await self.impl.stop()
