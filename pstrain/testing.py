"""An in-process cluster for tests: real servers, one process, no spawned children.

:class:`InProcessCluster` starts ps and worker *servers* in the caller's own
process and event loop, each bound to ``127.0.0.1:0`` before it is announced
(ready means listening), and hands out a resolver like
:class:`~pstrain.LocalCluster`'s. Everything still crosses real sockets
through the real stream protocol; only the process boundary is gone, so a
test starts in milliseconds and its failures show one traceback.

Leaving the ``async with`` block stops every server and closes the channels
opened on the loop, then **checks for leaks**: a task still running, a
channel still open or a server connection still registered fails the block
with :class:`LeakError`. When the block ends with an error (a test timeout
included), the stacks of every task on the loop are printed first.

Use :class:`~pstrain.LocalCluster` instead when the behaviour is about
processes: a SIGKILL, a restart, signals, the CLI.

::

    async with pstrain.testing.InProcessCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        ...
"""

from __future__ import annotations

import asyncio
import io
import secrets
import sys
import time
from typing import Any

from ._base.cluster import ClusterSpec
from ._base.errors import InvalidArgumentError, PstrainError
from ._base.resolvers import RunningCluster
from ._formats.messages.operations import OPERATIONS
from ._formats.messages.records import convert_reply, sender_fields
from ._transport import wire
from ._transport.channels import Channel, close_loop_channels, open_channels
from .server.ps.handlers import ParameterServer
from .server.worker.executor import WorkerServer

__all__ = ["InProcessCluster", "LeakError", "dump_task_stacks", "untyped_call"]


class LeakError(AssertionError):
    """Something a test started outlived it: a task, a channel, a connection."""


def dump_task_stacks(file: Any = None) -> str:
    """Print (and return) the stack of every task on the running loop."""
    out = io.StringIO()
    current = asyncio.current_task()
    for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
        if task is current:
            continue
        out.write(f"--- {task!r}\n")
        task.print_stack(file=out)
    text = out.getvalue()
    print(text, file=file or sys.stderr)
    return text


class InProcessCluster(RunningCluster):
    """``num_ps`` ps and ``num_workers`` workers as servers in this process (``async with``)."""

    def __init__(
        self,
        num_ps: int = 2,
        num_workers: int = 2,
        token: str | None = None,
        *,
        leak_grace_s: float = 2.0,
        ps_options: dict[str, Any] | None = None,
        **server_options: Any,
    ) -> None:
        if num_ps < 1 or num_workers < 1:
            raise InvalidArgumentError("a cluster needs at least one ps and one worker")
        self.num_ps = num_ps
        self.num_workers = num_workers
        self.token = token or secrets.token_urlsafe(24)
        self.leak_grace_s = leak_grace_s
        self.server_options = server_options
        self.ps_options = ps_options or {}
        self.ps: list[ParameterServer] = []
        self.workers: list[WorkerServer] = []
        self._tasks_before: set[asyncio.Task[Any]] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> InProcessCluster:
        """Start every server; each listens before this returns."""
        self._tasks_before = set(asyncio.all_tasks())
        try:
            for i in range(self.num_ps):
                server = ParameterServer(i, token=self.token, **self.server_options, **self.ps_options)
                await server.start()
                self.ps.append(server)
            for i in range(self.num_workers):
                worker = WorkerServer(i, token=self.token, **self.server_options)
                await worker.start()
                self.workers.append(worker)
        except BaseException:
            await self._stop_servers()
            raise
        return self

    async def __aenter__(self) -> InProcessCluster:
        return await self.start()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            dump_task_stacks()
        await self.close(check_leaks=exc is None)

    async def _stop_servers(self) -> None:
        for server in [*self.workers, *self.ps]:
            await server.stop()

    async def close(self, *, check_leaks: bool = True) -> None:
        """Stop every server, close this loop's channels, and check nothing leaked."""
        await self._stop_servers()
        await close_loop_channels()
        if check_leaks:
            await self.check_leaks()

    async def check_leaks(self) -> None:
        """Fail with :class:`LeakError` if a task, channel or connection outlived the test."""
        deadline = time.monotonic() + self.leak_grace_s
        current = asyncio.current_task()
        while True:
            tasks = [t for t in asyncio.all_tasks() - self._tasks_before if t is not current]
            channels = open_channels()
            connections = [c for s in [*self.ps, *self.workers] for c in s.connections]
            if not (tasks or channels or connections):
                return
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        lines = (
            [f"task {t!r}" for t in tasks]
            + [f"open channel to {c.task}" for c in channels]
            + [f"server connection {c!r}" for c in connections]
        )
        if tasks:
            dump_task_stacks()
        raise LeakError("leaked after the test:\n  " + "\n  ".join(lines))

    # -- what the coordinator needs ------------------------------------------------------------------
    def _addresses(self, servers: list[Any]) -> list[str]:
        if not all(s.address for s in servers):
            raise PstrainError("the InProcessCluster is not started")
        return [s.address for s in servers]

    @property
    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec({"ps": self._addresses(self.ps), "worker": self._addresses(self.workers)})


async def untyped_call(
    channel: Channel, op: str, payload: Any = None, *, pickle: bool = False, timeout: float | None = None
) -> Any:
    """Send a hand-built ``payload`` to operation ``op`` and return the decoded reply, checked
    against the operation's reply class but left as decoded: for tests (and attacks) that
    build bodies by hand. pstrain itself, and programs, send typed operations
    (``channel.request(ListVariables())``), whose both ends mypy checks.

    ``pickle`` allows pickled objects both ways (only for peers that run code: workers, and
    the ps's ``extended.update``). An operation's sender fields (its owner, fence and
    exactly-once key) are filled in as :meth:`Channel.request` fills them.
    """
    operation = OPERATIONS.get(op)
    if (
        operation is not None
        and isinstance(payload, dict)
        and (fields := sender_fields(operation, channel.task, channel.session.owner))
    ):
        payload = {**payload, **fields}
    chunks = wire.encode_body(payload, allow_pickle=pickle)
    kind, body = await channel.call_raw(op, chunks, timeout=timeout)
    reply = channel.decode_reply(kind, body, pickle=pickle)
    if operation is not None:
        convert_reply(op, operation.reply, reply, channel.task)
    return reply
