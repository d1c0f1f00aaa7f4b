"""A server's lifecycle: bind one port, serve both transports, stop cleanly.

``await server.start()`` binds (port 0 picks one) and returns the real
address; each accepted connection is sniffed (``_transport/listener.py``): one that opens
with the stream's ``MAGIC`` is pstrain's own multiplexed stream, anything
else goes to aiohttp (``http.py``), which is loaded when the first such connection
arrives (:class:`HttpOnDemand`). ``await stop()`` closes the listener and
every connection, then cancels the tasks the server owns. A server still running when its
event loop ends (``asyncio.run``, ``pstrain.run`` or a test runner finishing the loop's
async generators) is stopped then: a program that never stopped it, a test that failed
before it could, does not leave it listening.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import logging
import sys
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from .._base.cluster import listening_socket, local_listener, local_socket_name
from .._base.errors import PstrainError
from .._base.exports import expose
from .._formats.messages.operations import Shutdown
from .._formats.messages.records import EmptyReply
from .._transport.listener import Sniffer
from .._transport.preauth import PreAuth, preauth_cap
from .core import ServerCore, Status

if TYPE_CHECKING:
    from .http import HttpAdapter

logger = logging.getLogger(__name__)

__all__ = ["HTTP_FACE_BYTES", "HttpOnDemand", "ServerBase", "http_face_to_come"]

#: Resident memory a server's HTTP face adds once set up (aiohttp and the application:
#: 13.5 MB measured), with some room.
HTTP_FACE_BYTES = 16 << 20


def http_face_to_come() -> int:
    """Bytes this process's HTTP face will add when it is set up: ``HTTP_FACE_BYTES`` until
    aiohttp's server is loaded (by the face or by anything else in the process), then 0
    (what a limit reckoned from the memory a process holds now leaves room for)."""
    return 0 if "aiohttp.web" in sys.modules else HTTP_FACE_BYTES


class HttpOnDemand:
    """A server's HTTP face (:class:`~pstrain._serving.http.HttpAdapter`), set up when the
    first connection that is not the stream arrives. Most servers of a job (the ps and
    workers the coordinator reaches by the stream) never serve HTTP, and importing aiohttp
    costs each process about 0.3 s of CPU; the import runs on a thread, so the server keeps
    serving meanwhile. The sniffer asks :meth:`protocol` and, while it is None, waits on
    :meth:`start`."""

    def __init__(self, server: ServerCore, authenticated: Callable[[asyncio.BaseTransport], None]) -> None:
        self.server = server
        self.authenticated = authenticated
        self._adapter: HttpAdapter | None = None
        self._factory: Callable[[], asyncio.Protocol] | None = None
        self._starting: asyncio.Task[None] | None = None

    def protocol(self) -> asyncio.Protocol | None:
        """A protocol for one HTTP connection, or None until :meth:`start` is done."""
        return None if self._factory is None else self._factory()

    def start(self) -> asyncio.Future[None]:
        """Set aiohttp's application up (once; a start that failed is tried again by the
        next connection)."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        return self._starting

    async def _start(self) -> None:
        try:
            module = await asyncio.to_thread(importlib.import_module, f"{__package__}.http")
            adapter = module.HttpAdapter(self.server, authenticated=self.authenticated)
            factory = await adapter.start()
        except Exception:
            logger.exception("%s: could not set up its HTTP face", self.server.task)
            self._starting = None
            raise
        self._adapter, self._factory = adapter, factory

    async def stop(self) -> None:
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()
        if starting is not None:
            await asyncio.gather(starting, return_exceptions=True)
        adapter, self._adapter, self._factory = self._adapter, None, None
        if adapter is not None:
            await adapter.stop()


class ServerBase(ServerCore):
    """A :class:`ServerCore` that listens: ``start``, ``join``, ``stop``."""

    #: Called in the context the server starts in, a copy of the caller's: its handlers, its
    #: tasks and their ``asyncio.to_thread`` calls all run in copies of it (a ps's allocator).
    setup_context: Callable[[], object] | None = None

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out.update(
            preauth_waiting=len(self.preauth),
            preauth_expired=self.preauth.expired,
            preauth_evicted=self.preauth.evicted,
        )
        return out

    def __init__(self, role: str, index: int, *, exit_on_shutdown: bool = False, **options: Any) -> None:
        super().__init__(role, index, **options)
        # the cap follows the descriptors this process may open (and raises its soft limit)
        self.preauth = PreAuth(preauth_cap(self.max_unauthenticated), self.handshake_timeout_s)
        #: Set by ``server/shutdown`` (the coordinator's job is done) when allowed at start.
        self.shutdown_requested = asyncio.Event()
        if exit_on_shutdown:
            self.route(Shutdown, self._shutdown)
        else:
            self.refuse(
                Shutdown,
                f"{self.task} was not started with --exit-on-shutdown: it outlives the jobs that use it",
            )
        self._server: asyncio.AbstractServer | None = None
        self._local_server: asyncio.AbstractServer | None = None  # same-host clients
        self._http: HttpOnDemand | None = None
        self._closed: asyncio.Event | None = None
        self._loop_end: AsyncGenerator[None, None] | None = None  # see _stop_with_loop

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and serve; returns the real ``host:port`` (port 0 picks one)."""
        context = contextvars.copy_context()
        if self.setup_context is not None:
            context.run(self.setup_context)
        return await asyncio.create_task(self._start(), context=context)

    async def _start(self) -> str:
        if self.status is not Status.INIT:
            raise PstrainError(f"server {self.task} already started")
        loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        sock = listening_socket(self.host, self.port, self.task, bound=self.bound)
        # Past the bearer token a connection leaves the pre-auth set: its deadline and the
        # cap no longer apply (the documented keep-alive and body deadlines do).
        http = self._http = HttpOnDemand(self, authenticated=self.preauth.authenticated)

        def sniffer() -> Sniffer:
            return Sniffer(self, self.preauth, http)

        self._server = await loop.create_server(sniffer, sock=sock, ssl=self.ssl_context)
        host, port = sock.getsockname()[:2]
        try:
            await self._listen_locally(loop, host, port, sniffer)
        except PstrainError:  # not started: the port is given back
            self._server.close()
            await self._server.wait_closed()
            await self._http.stop()
            self._server = self._http = None
            raise
        self.port = port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.status = Status.RUNNING
        self.started_at = time.time()
        self._loop_end = self._stop_with_loop()
        await self._loop_end.__anext__()
        logger.info("%s listening on %s", self.task, self.address)
        if self.token_bytes is None:
            logger.warning(
                "%s has no cluster token: any local user can run code through it "
                "(set PSTRAIN_TOKEN or --token-file)",
                self.task,
            )
        return self.address

    async def _listen_locally(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int, factory: Callable[[], Sniffer]
    ) -> None:
        """On loopback without TLS, listen on the address's local socket too
        (:func:`~pstrain._base.cluster.local_socket_name`): the same connections, sniffed
        and authenticated alike, one copy cheaper per byte. A name another process holds
        fails the start, as a port it holds does: this host's clients would reach that
        process there (and, without a token, could not tell it from this server)."""
        name = None if self.ssl_context is not None else local_socket_name(host, port)
        if name is None:
            return
        sock = local_listener(name)
        if sock is None:  # as a taken port: clients on this host would reach its holder
            raise PstrainError(
                f"{self.task} cannot listen on {host}:{port}: another process holds its local "
                f"socket ({name[1:]!r} in the abstract namespace). Stop that process, or set "
                "PSTRAIN_LOCAL_SOCKETS=0 on this server and its clients to use TCP only"
            )
        self._local_server = await loop.create_unix_server(factory, sock=sock)

    async def _stop_with_loop(self) -> AsyncGenerator[None, None]:
        """Suspended while the server runs: the loop's ``shutdown_asyncgens``, which every
        runner calls as a loop ends (after cancelling its tasks), closes it, and the server
        is stopped if it still runs. Left open, uvloop warns of it from inside its
        ``close``, which then waits for good where warnings are errors (a pytest run with
        ``filterwarnings = error``). An async generator rather than a task: nothing a
        test's check for leaked tasks counts."""
        try:
            yield
        finally:
            if self._loop_end is not None:  # (not closed by ``stop`` itself)
                self._loop_end = None
                await self.stop()

    async def join(self) -> None:
        """Wait until the server has stopped."""
        if self._closed is not None:
            await self._closed.wait()

    def _shutdown(self, _: Shutdown) -> EmptyReply:
        """The job that uses this task is done: leave (``pstrain serve`` stops on this)."""
        logger.info("%s: the coordinator's job is done; leaving", self.task)
        self.shutdown_requested.set()
        return EmptyReply()

    async def stop(self) -> None:
        """Stop listening, close every connection, cancel handler tasks."""
        if self.status in (Status.CLOSING, Status.CLOSED) or self._server is None:
            self.status = Status.CLOSED
            return
        self.status = Status.CLOSING
        await self.before_stop()
        self._server.close()
        if self._local_server is not None:
            self._local_server.close()
        self.preauth.close()
        for transport in list(self.connections):
            transport.close()
        await self.tasks.close()
        if self._http is not None:
            await self._http.stop()
        await self._server.wait_closed()
        if self._local_server is not None:
            await self._local_server.wait_closed()
        await self.on_stop()
        self.status = Status.CLOSED
        assert self._closed is not None
        self._closed.set()
        logger.info("%s stopped", self.task)
        loop_end, self._loop_end = self._loop_end, None
        if loop_end is not None:  # stopped before its loop ends: nothing left for it to do
            await loop_end.aclose()

    async def before_stop(self) -> None:
        """Role-specific goodbyes, while connections are still open (they close next)."""

    async def on_stop(self) -> None:
        """Role-specific clean-up; called once the port is closed."""


expose(globals(), "pstrain.server", ["ServerBase"])
