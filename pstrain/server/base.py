"""What every pstrain server shares: one port, two protocols, one handler table.

A server binds one socket. Each accepted connection is sniffed: one that
opens with ``rpc.MAGIC`` is the multiplexed stream (its token is checked in
constant time before any frame is read); anything else is handed to aiohttp,
which serves ``POST /v1/<op>`` (bearer token checked by a middleware before
the body is read), ``GET /v1/health`` and ``GET /healthz``. Both reach the
same table of handlers, so an operation behaves the same either way.

Handlers take the decoded request and return the reply object. Plain
functions run inline on the loop (the ps relies on this: an update runs with
no ``await`` inside, so it is atomic); coroutine functions become tasks owned
by the server. A handler may return :class:`Pinned` to send an array without
copying it and learn when the bytes have left.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import inspect
import ipaddress
import json
import logging
import os
import socket
import ssl as ssl_module
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .. import wire
from ..errors import (
    AuthenticationError,
    InvalidArgumentError,
    NotFoundError,
    ProtocolError,
    PstrainError,
    status_for,
    to_envelope,
)
from ..rpc import (
    ACCEPTED,
    CONTENT_TYPE,
    DEFAULT_MAX_BODY,
    ERROR,
    HANDSHAKE,
    MAGIC,
    PARTIAL,
    REJECTED,
    REPLY,
    REQUEST,
    FrameProtocol,
)

logger = logging.getLogger(__name__)

__all__ = ["Encoded", "Handler", "Pinned", "ServerBase", "Status"]


class Status(enum.Enum):
    """Lifecycle of a server."""

    INIT = "init"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class Handler:
    fn: Callable[..., Any]
    pickle: bool  # decode pickled request objects and encode the reply with pickles
    is_async: bool
    stream: bool  # called as fn(payload, emit); emit(obj) sends a partial reply (None over HTTP)


class Encoded:
    """A reply already encoded (``wire.encode_body`` chunks); sent as is."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: list[bytes | memoryview]) -> None:
        self.chunks = chunks


class Pinned:
    """A reply whose arrays are shared with server state until sent.

    ``release`` is called once the reply's bytes have left the process.
    """

    __slots__ = ("value", "release")

    def __init__(self, value: Any, release: Callable[[], None]) -> None:
        self.value = value
        self.release = release


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerBase:
    """Binds, serves the handler table over HTTP and the stream, and stops."""

    def __init__(self, role: str, index: int, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, ssl_context: ssl_module.SSLContext | None = None,
                 max_body: int = DEFAULT_MAX_BODY, metrics_public: bool = False) -> None:
        if not is_loopback(host) and not token:
            raise InvalidArgumentError(
                f"refusing to listen on {host!r} without a cluster token: anyone who can reach "
                "it could run code on this cluster. Set PSTRAIN_TOKEN or --token-file, "
                "or bind 127.0.0.1")
        self.role = role
        self.index = index
        self.host = host
        self.port = port
        self.token = token
        self._token_bytes = token.encode() if token else None
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.metrics_public = metrics_public
        self.status = Status.INIT
        self.address: str | None = None
        self.started_at = time.time()
        self.handlers: dict[str, Handler] = {}
        self.stats: dict[str, list[int]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connections: set[asyncio.BaseTransport] = set()
        self._server: asyncio.AbstractServer | None = None
        self._runner: web.AppRunner | None = None
        self._closed: asyncio.Event | None = None
        self.route("health", self.health)
        self.route("statistics", self.statistics)

    @property
    def task(self) -> str:
        return f"/job:{self.role}/replica:0/task:{self.index}"

    def route(self, op: str, fn: Callable[..., Any], *, pickle: bool = False,
              stream: bool = False) -> None:
        """Serve ``fn`` as ``op`` (``POST /v1/<op>`` and stream op ``<op>``)."""
        self.handlers[op] = Handler(fn, pickle, inspect.iscoroutinefunction(fn), stream)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and serve; returns the real ``host:port`` (port 0 picks one)."""
        if self.status is not Status.INIT:
            raise PstrainError(f"server {self.task} already started")
        loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise PstrainError(f"{self.task} cannot listen on {self.host}:{self.port}: "
                               f"{exc.strerror or exc}") from exc
        sock.listen(1024)
        sock.setblocking(False)
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._auth_middleware(request, handler)

        app = web.Application(middlewares=[auth], client_max_size=self.max_body)
        app.router.add_route("POST", "/v1/{op:.+}", self._http_op)
        app.router.add_route("GET", "/v1/health", self._http_health)
        app.router.add_route("GET", "/healthz", self._http_health)
        app.router.add_route("GET", "/metrics", self._http_metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        http_factory = self._runner.server
        assert http_factory is not None
        self._server = await loop.create_server(
            lambda: _Sniffer(self, http_factory), sock=sock, ssl=self.ssl_context)
        host, port = sock.getsockname()[:2]
        self.port = port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.status = Status.RUNNING
        self.started_at = time.time()
        logger.info("%s listening on %s", self.task, self.address)
        return self.address

    async def join(self) -> None:
        """Wait until the server has stopped."""
        if self._closed is not None:
            await self._closed.wait()

    async def stop(self) -> None:
        """Stop listening, close every connection, cancel handler tasks."""
        if self.status in (Status.CLOSING, Status.CLOSED) or self._server is None:
            self.status = Status.CLOSED
            return
        self.status = Status.CLOSING
        self._server.close()
        for transport in list(self._connections):
            transport.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await self._server.wait_closed()
        await self.on_stop()
        self.status = Status.CLOSED
        assert self._closed is not None
        self._closed.set()
        logger.info("%s stopped", self.task)

    async def on_stop(self) -> None:
        """Role-specific clean-up; called once the port is closed."""

    # -- built-in handlers -------------------------------------------------------------
    def health(self, _: Any) -> dict[str, Any]:
        return {"status": self.status.value, "role": self.role, "index": self.index,
                "task": self.task, "pid": os.getpid(),
                "uptime_s": time.time() - self.started_at}

    def statistics(self, _: Any) -> dict[str, Any]:
        return {"task": self.task, "uptime_s": time.time() - self.started_at,
                "requests": {op: {"count": c, "bytes_in": bi, "bytes_out": bo, "seconds": sec}
                             for op, (c, bi, bo, sec) in self.stats.items()}}

    # -- dispatch --------------------------------------------------------------------------
    def _count(self, op: str, bytes_in: int, bytes_out: int, seconds: float = 0.0) -> None:
        entry = self.stats.get(op)
        if entry is None:
            entry = self.stats[op] = [0, 0, 0, 0.0]
        entry[0] += 1
        entry[1] += bytes_in
        entry[2] += bytes_out
        entry[3] += seconds

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` as a task this server owns (cancelled on stop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task failed", self.task, exc_info=task.exception())

    def error_chunks(self, exc: BaseException) -> list[bytes | memoryview]:
        tb = None if isinstance(exc, PstrainError) else traceback.format_exc()
        if tb is not None:
            logger.error("%s: unexpected error while serving a request", self.task, exc_info=exc)
        return wire.encode_body(to_envelope(exc, self.task, tb))


    # -- HTTP side ----------------------------------------------------------------------
    async def _http_metrics(self, request: web.Request) -> web.Response:
        from ..observability import CONTENT_TYPE, make_registry, render

        if self._registry is None:
            self._registry = make_registry({"role": self.role, "index": str(self.index)},
                                           lambda: self.statistics(None))
        return web.Response(body=render(self._registry), headers={"Content-Type": CONTENT_TYPE})

    _registry: Any = None

    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/metrics" and self.metrics_public:
            return await handler(request)
        if self._token_bytes is not None:
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                     self._token_bytes):
                return _json_error(AuthenticationError(
                    "missing or wrong cluster token: send 'Authorization: Bearer <token>'"),
                    self.task, 401)
        return await handler(request)

    async def _http_health(self, request: web.Request) -> web.Response:
        return web.json_response(self.health(None))

    async def _http_op(self, request: web.Request) -> web.StreamResponse:
        op = request.match_info["op"]
        handler = self.handlers.get(op)
        if handler is None:
            return _json_error(NotFoundError(f"{self.task} has no operation {op!r}"), self.task)
        length = request.content_length
        if length is not None and length > self.max_body:
            return _json_error(ProtocolError(
                f"request body of {length} bytes is larger than this server's limit of "
                f"{self.max_body} bytes"), self.task, 413)
        try:
            if length is None:
                body: bytes | bytearray = await request.read()
            else:
                body = bytearray(length)
                pos = 0
                async for chunk in request.content.iter_any():
                    end = pos + len(chunk)
                    if end > length:
                        raise ProtocolError("request body is longer than its Content-Length")
                    body[pos:end] = chunk
                    pos = end
                if pos != length:
                    raise ProtocolError(f"truncated request body: {pos} of {length} bytes")
        except web.HTTPRequestEntityTooLarge:
            return _json_error(ProtocolError(
                f"request body is larger than this server's limit of {self.max_body} bytes"),
                self.task, 413)
        except ProtocolError as exc:
            return _json_error(exc, self.task)
        release = None
        try:
            payload = wire.decode_body(body, allow_pickle=handler.pickle)
            result = handler.fn(payload, None) if handler.stream else handler.fn(payload)
            if handler.is_async:
                result = await result
            if isinstance(result, Pinned):
                result, release = result.value, result.release
            chunks = result.chunks if isinstance(result, Encoded) else \
                wire.encode_body(result, allow_pickle=handler.pickle)
            out = b"".join(chunks)
        except Exception as exc:
            if not isinstance(exc, PstrainError):
                logger.error("%s: unexpected error serving %s", self.task, op, exc_info=exc)
            self._count(op, len(body), 0)
            return _json_error(exc, self.task)
        finally:
            if release is not None:
                release()
        self._count(op, len(body), len(out))
        return web.Response(body=out, content_type=CONTENT_TYPE)



class _StreamServer(FrameProtocol):
    """The server end of a stream connection (after the handshake)."""

    def __init__(self, server: ServerBase) -> None:
        super().__init__(server.max_body)
        self.server = server

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.transport is not None:
            self.server._connections.discard(self.transport)

    def oversized(self, req_id: int, op: str) -> None:
        exc = ProtocolError(f"request to {op!r} is larger than this server's limit of "
                            f"{self.server.max_body} bytes (413)")
        self._reply_error(req_id, exc)

    def _reply_error(self, req_id: int, exc: BaseException) -> None:
        try:
            self.send(req_id, ERROR, "", self.server.error_chunks(exc))
        except PstrainError:
            pass  # connection gone; nobody to tell

    def handle_frame(self, req_id: int, kind: int, op: str, body: memoryview) -> None:
        if kind != REQUEST:
            return
        server = self.server
        handler = server.handlers.get(op)
        if handler is None:
            self._reply_error(req_id, NotFoundError(f"{server.task} has no operation {op!r}"))
            return
        started = time.perf_counter()
        try:
            payload = wire.decode_body(body, allow_pickle=handler.pickle)
            if handler.is_async:
                server.spawn(self._run_async(req_id, op, handler, payload, body.nbytes, started))
                return
            result = handler.fn(payload, self._emitter(req_id, handler)) if handler.stream \
                else handler.fn(payload)
        except Exception as exc:  # every failure is reported to the caller
            self._reply_error(req_id, exc)
            server._count(op, body.nbytes, 0, time.perf_counter() - started)
            return
        self._reply(req_id, op, handler, result, body.nbytes, started)

    async def _run_async(self, req_id: int, op: str, handler: Handler, payload: Any,
                         size_in: int, started: float) -> None:
        try:
            if handler.stream:
                result = await handler.fn(payload, self._emitter(req_id, handler))
            else:
                result = await handler.fn(payload)
        except asyncio.CancelledError:
            self._reply_error(req_id, PstrainError(f"{self.server.task} is shutting down"))
            raise
        except Exception as exc:
            self._reply_error(req_id, exc)
            return
        self._reply(req_id, op, handler, result, size_in, started)

    def _emitter(self, req_id: int, handler: Handler) -> Callable[[Any], None]:
        def emit(obj: Any) -> None:
            chunks = obj.chunks if isinstance(obj, Encoded) else \
                wire.encode_body(obj, allow_pickle=handler.pickle)
            self.send(req_id, PARTIAL, "", chunks)

        return emit

    def _reply(self, req_id: int, op: str, handler: Handler, result: Any, size_in: int,
               started: float) -> None:
        release = None
        if isinstance(result, Pinned):
            result, release = result.value, result.release
        try:
            chunks = result.chunks if isinstance(result, Encoded) else \
                wire.encode_body(result, allow_pickle=handler.pickle)
        except Exception as exc:
            if release is not None:
                release()
            self._reply_error(req_id, exc)
            return
        self.server._count(op, size_in, wire.body_size(chunks), time.perf_counter() - started)
        try:
            self.send(req_id, REPLY, "", chunks, on_flushed=release)
        except PstrainError:
            pass


class _Sniffer(asyncio.Protocol):
    """Decides per connection: the pstrain stream or HTTP."""

    def __init__(self, server: ServerBase, http_factory: Callable[[], asyncio.Protocol]) -> None:
        self.server = server
        self.http_factory = http_factory
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._connections.add(transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        buf = self.buf
        transport = self.transport
        assert transport is not None
        if len(buf) < len(MAGIC) and MAGIC.startswith(buf):
            return  # not enough to tell yet
        if not buf.startswith(MAGIC):
            self.server._connections.discard(transport)
            proto = self.http_factory()
            transport.set_protocol(proto)
            proto.connection_made(transport)
            proto.data_received(buf)
            return
        head = len(MAGIC) + HANDSHAKE.size
        if len(buf) < head:
            return
        (token_len,) = HANDSHAKE.unpack_from(buf, len(MAGIC))
        if len(buf) < head + token_len:
            return
        token = buf[head:head + token_len]
        expected = self.server._token_bytes
        if expected is not None and not hmac.compare_digest(token, expected):
            logger.warning("%s: rejected a stream connection from %s: wrong or missing token",
                           self.server.task, transport.get_extra_info("peername"))
            transport.write(MAGIC + REJECTED)
            transport.close()
            return
        transport.write(MAGIC + ACCEPTED)
        stream = _StreamServer(self.server)
        transport.set_protocol(stream)
        stream.connection_made(transport)
        rest = buf[head + token_len:]
        self.buf = b""
        if rest:
            stream.feed(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server._connections.discard(self.transport)


def _json_error(exc: BaseException, task: str, status: int | None = None) -> web.Response:
    return web.Response(status=status or status_for(exc), content_type="application/json",
                        text=json.dumps({"error": to_envelope(exc, task)}))
