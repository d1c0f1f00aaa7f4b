"""What every pstrain server shares: a handler table and the one reply path.

A server (``base.py`` adds its lifecycle) receives operations over two
transports: the pstrain stream (``_transport/listener.py``) and HTTP (``http.py``). Both
call :meth:`ServerCore.handle`, the one path from an operation's bytes to
its reply: look the handler up, decode the body, call the handler, encode
the result or the error, count it. So an operation behaves the same either
way, and this part does no I/O.

Handlers take the decoded request and return the reply object. Plain
functions run inline on the loop (the ps relies on this: an update runs with
no ``await`` inside, so it is atomic); coroutine functions become tasks owned
by the server's :class:`~pstrain._base.tasks.TaskOwner`. A handler may return
:class:`Pinned` to send an array without copying it and learn when the bytes
have left, or :class:`Encoded` chunks it encoded itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import inspect
import logging
import os
import secrets
import socket
import ssl as ssl_module
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeAlias, Union

from .._base.auth import normalize_token
from .._base.cluster import is_loopback, task_name
from .._base.errors import (
    ImportNeeded,
    InvalidArgumentError,
    NotFoundError,
    PstrainError,
    to_envelope,
)
from .._base.exports import expose
from .._base.machine import resident_memory
from .._base.tasks import TaskOwner
from .._formats.messages.operations import Health, Statistics
from .._formats.messages.records import HealthReply, Operation, R, validate
from .._transport import wire
from .._transport.frames import DEFAULT_MAX_BODY, BodyBudget, FrameKind
from .._transport.listener import Reply

logger = logging.getLogger(__name__)

__all__ = ["Download", "Encoded", "Handler", "Pinned", "ServerCore", "Status"]


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
    request: type[Operation[Any]]  # the operation's declared class (operations.py)
    refused: str | None = None  # an operation this server refuses, and why


class Encoded:
    """A reply already encoded (``wire.encode_body`` chunks); sent as is."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: list[bytes | memoryview]) -> None:
        self.chunks = chunks


class Pinned(Generic[R]):
    """A reply whose arrays are shared with server state until sent.

    ``release`` is called once the reply's bytes have left the process.
    """

    __slots__ = ("value", "release")

    def __init__(self, value: R, release: Callable[[], None]) -> None:
        self.value = value
        self.release = release


#: A handler of an operation whose reply is ``R``: plain or async, given the request (and,
#: for a streaming operation, the function that sends partial replies), it returns the
#: reply, the reply already encoded (a worker's results), or the reply pinned (arrays
#: shared with the server until sent).
# (written out, and with Union: mypy matches a nested generic alias poorly)
HandlerFn: TypeAlias = Callable[..., Union[R, Encoded, Pinned[R], Awaitable[Union[R, Encoded, Pinned[R]]]]]  # noqa: UP007, E501


class Router(Protocol):
    """Where handlers are routed (a server's :meth:`ServerCore.route`): the parts of a
    server route their operations at its construction, each checked by mypy against the
    operation's declared reply."""

    def __call__(self, operation: type[Operation[R]], fn: HandlerFn[R]) -> None: ...


@dataclass
class Download:
    """The answer of an HTTP download (:meth:`ServerCore.download`): bytes sent in pieces,
    with their type and extra headers. ``chunks`` go first; then ``stream``'s pieces, each
    made on a thread as the one before has been taken by the peer, ``length`` bytes in
    all, so a large answer is never in memory whole. ``close`` is called once the download
    has ended, sent or not."""

    chunks: list[bytes | memoryview]
    content_type: str = "application/octet-stream"
    headers: dict[str, str] | None = None
    stream: Iterator[bytes | memoryview] | None = None
    length: int = 0
    close: Callable[[], None] | None = None


class ServerCore:
    """The handler table of one task, and the path from a request to its reply."""

    def __init__(
        self,
        role: str,
        index: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        ssl_context: ssl_module.SSLContext | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        metrics_public: bool = False,
        handshake_timeout_s: float = 5.0,
        max_unauthenticated: int = 1024,
        max_backlog_bytes: int = 16 << 20,
        large_body_budget: int = DEFAULT_MAX_BODY,
        keepalive_s: float = 30.0,
    ) -> None:
        token = normalize_token(token)  # an empty token is no token
        if not is_loopback(host) and not token:
            raise InvalidArgumentError(
                f"refusing to listen on {host!r} without a cluster token: anyone who can reach "
                "it could run code on this cluster. Set PSTRAIN_TOKEN or --token-file, "
                "or bind 127.0.0.1"
            )
        self.role = role
        self.index = index
        self.host = host
        self.port = port
        #: A socket bound to ``host:port`` by the process that started this one, to listen
        #: on instead of binding (``pstrain serve --listen-fd``).
        self.bound: socket.socket | None = None
        self.token = token
        self.token_bytes = token.encode() if token else None
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.metrics_public = metrics_public
        self.max_backlog_bytes = max_backlog_bytes
        self.keepalive_s = keepalive_s
        self.budget = BodyBudget(large_body_budget)
        self.handshake_timeout_s = handshake_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.status = Status.INIT
        self.address: str | None = None
        self.started_at = time.time()
        #: This process's life: a restarted server (its state lost) has a new one.
        self.incarnation = uuid.uuid4().hex
        self.handlers: dict[str, Handler] = {}
        self.internal_errors = 0
        self.stats: dict[str, list[Any]] = {}
        self.tasks = TaskOwner(f"server {self.task}")
        self.connections: set[asyncio.BaseTransport] = set()
        #: HTTP pages that authenticate requests themselves (see :meth:`page`).
        self.pages: dict[tuple[str, str], Callable[..., Awaitable[Any]]] = {}
        #: HTTP downloads behind the cluster token (see :meth:`download`).
        self.downloads: dict[str, Callable[[dict[str, str], dict[str, str]], Awaitable[Download]]] = {}
        self.route(Health, self.health)
        self.route(Statistics, self.statistics)

    #: A worker started with ``--join`` answers to whatever worker index it is dialled as
    #: (the coordinator gives it a slot); every other task only to its own name.
    answers_any_index = False

    @property
    def task(self) -> str:
        return task_name(self.role, self.index)

    def route(self, operation: type[Operation[R]], fn: HandlerFn[R]) -> None:
        """Serve ``operation`` (``POST /v1/<op>`` and stream op ``<op>``) with ``fn``, which
        receives the request as an instance of ``operation`` and returns its declared reply
        (``Operation[R]``: an ``R``, checked by mypy). Whether its body may carry
        pickles and whether ``fn`` streams partial replies (``fn(request, emit)``) are the
        operation's declaration."""
        self.handlers[operation.op()] = Handler(
            fn, operation.pickle, inspect.iscoroutinefunction(fn), operation.stream, operation
        )

    def page(self, method: str, path: str, handler: Callable[..., Awaitable[Any]]) -> None:
        """Serve the HTTP page ``method path`` with ``handler(request, authenticated)``, which
        checks the request itself (a browser's session cookie, say) and calls
        ``authenticated()`` once it has: that ends the connection's pre-auth deadline, as the
        cluster token does for every other request. Only pages skip the token check."""
        self.pages[(method, path)] = handler

    def download(
        self, path: str, handler: Callable[[dict[str, str], dict[str, str]], Awaitable[Download]]
    ) -> None:
        """Serve ``GET path`` (an aiohttp pattern, ``/v1/tables/{name}/rows``) behind the
        cluster token with ``handler(path parameters, query parameters)``, which returns a
        :class:`Download` or raises a pstrain error (sent as JSON with its status)."""
        self.downloads[path] = handler

    def refuse(self, operation: type[Operation[Any]], reason: str) -> None:
        """Answer ``operation`` with an InvalidArgumentError giving ``reason``, before its body
        is decoded."""
        self.handlers[operation.op()] = Handler(_refused, False, False, False, operation, reason)

    def stream_closed(self, connection: Any) -> None:
        """A stream connection ended (the emitters of its requests carry it as their
        ``connection``): a server whose handlers outlive their caller stops their work."""

    # -- built-in handlers -------------------------------------------------------------
    def health(self, _: Health) -> HealthReply:
        return HealthReply(
            status=self.status.value,
            role=self.role,
            index=self.index,
            task=self.task,
            pid=os.getpid(),
            incarnation=self.incarnation,
            uptime_s=time.time() - self.started_at,
        )

    def statistics(self, _: Any) -> dict[str, Any]:
        return {
            "task": self.task,
            "uptime_s": time.time() - self.started_at,
            "task_failures": self.tasks.failures,
            "rss_bytes": resident_memory(),
            "requests": {
                op: {"count": c, "bytes_in": bi, "bytes_out": bo, "seconds": sec}
                for op, (c, bi, bo, sec) in self.stats.items()
            },
        }

    # -- the one path from request bytes to a reply -----------------------------------------
    def handle(
        self, op: str, body: memoryview | bytes | bytearray, emit: Callable[[Any], None] | None
    ) -> Reply | Coroutine[Any, Any, Reply]:
        """The reply to ``op`` with ``body``: at once for a plain handler, else a coroutine.

        ``emit`` sends partial replies for streaming handlers (None over HTTP).
        """
        started = time.perf_counter()
        size_in = len(body) if not isinstance(body, memoryview) else body.nbytes
        handler = self.handlers.get(op)
        try:
            if handler is None:
                raise NotFoundError(f"{self.task} has no operation {op!r}")
            if handler.refused is not None:
                raise InvalidArgumentError(handler.refused)
            # Nothing imports on this loop (torch's first import takes seconds, health checks
            # and every other request would wait): a body whose pickles would is decoded on a
            # thread, and its handler called here after (a plain one still runs in one step).
            decoded = wire.decode_body(
                body,
                allow_pickle=handler.pickle,
                imports=False,
                pickle_failures_kept=handler.request.pickle_failures_kept,
            )
        except ImportNeeded:
            assert handler is not None
            return self._decoded_on_a_thread(op, handler, body, emit, size_in, started)
        except Exception as exc:  # every failure is reported to the caller
            return self.error_reply(op, exc, size_in, started)
        return self._call(op, handler, decoded, emit, size_in, started)

    def _call(
        self,
        op: str,
        handler: Handler,
        decoded: Any,
        emit: Callable[[Any], None] | None,
        size_in: int,
        started: float,
    ) -> Reply | Coroutine[Any, Any, Reply]:
        try:
            payload = validate(op, handler.request, decoded).received()
            if handler.stream:
                result = handler.fn(payload, self._encoding_emitter(handler, emit))
            else:
                result = handler.fn(payload)
        except Exception as exc:  # every failure is reported to the caller
            return self.error_reply(op, exc, size_in, started)
        if handler.is_async:
            return self._awaited(op, handler, result, size_in, started)
        return self._reply(op, handler, result, size_in, started)

    async def _decoded_on_a_thread(
        self,
        op: str,
        handler: Handler,
        body: memoryview | bytes | bytearray,
        emit: Callable[[Any], None] | None,
        size_in: int,
        started: float,
    ) -> Reply:
        decode = functools.partial(
            wire.decode_body,
            body,
            allow_pickle=True,
            pickle_failures_kept=handler.request.pickle_failures_kept,
        )
        try:
            decoded = await asyncio.get_running_loop().run_in_executor(
                None, contextvars.copy_context().run, decode
            )
        except Exception as exc:
            return self.error_reply(op, exc, size_in, started)
        pending = self._call(op, handler, decoded, emit, size_in, started)
        return pending if isinstance(pending, Reply) else await pending

    async def _awaited(self, op: str, handler: Handler, pending: Any, size_in: int, started: float) -> Reply:
        try:
            result = await pending
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return self.error_reply(op, exc, size_in, started)
        return self._reply(op, handler, result, size_in, started)

    def _encoding_emitter(
        self, handler: Handler, emit: Callable[[Any], None] | None
    ) -> Callable[[Any], None] | None:
        if emit is None:
            return None

        def send(obj: Any) -> None:
            emit(
                obj.chunks if isinstance(obj, Encoded) else wire.encode_body(obj, allow_pickle=handler.pickle)
            )

        send.connection = getattr(emit, "connection", None)  # type: ignore[attr-defined]
        return send

    def _reply(self, op: str, handler: Handler, result: Any, size_in: int, started: float) -> Reply:
        release = None
        if isinstance(result, Pinned):
            result, release = result.value, result.release
        try:
            chunks = (
                result.chunks
                if isinstance(result, Encoded)
                else wire.encode_body(result, allow_pickle=handler.pickle)
            )
        except Exception as exc:
            if release is not None:
                release()
            return self.error_reply(op, exc, size_in, started)
        self._count(op, size_in, wire.body_size(chunks), time.perf_counter() - started)
        return Reply(FrameKind.REPLY, chunks, release)

    def error_reply(
        self, op: str, exc: BaseException, size_in: int = 0, started: float | None = None
    ) -> Reply:
        """An ERROR reply for ``exc``.

        A pstrain error travels as itself. Anything else is a bug of this server: it is
        logged here with its traceback under a short id, and the caller gets the id only
        (never a traceback or a path of this host).
        """
        if started is not None:
            self._count(op, size_in, 0, time.perf_counter() - started)
        if not isinstance(exc, PstrainError):
            incident = secrets.token_hex(4)
            logger.error("%s: internal error %s serving %s", self.task, incident, op, exc_info=exc)
            self.internal_errors += 1
            exc = PstrainError(
                f"internal error {incident} on {self.task} while serving {op!r}; its log has the details"
            )
        status = exc.http_status
        envelope = to_envelope(exc, self.task, None)
        return Reply(FrameKind.ERROR, wire.encode_body(envelope), None, status, envelope)

    def _count(self, op: str, bytes_in: int, bytes_out: int, seconds: float = 0.0) -> None:
        entry = self.stats.get(op)
        if entry is None:
            entry = self.stats[op] = [0, 0, 0, 0.0]
        entry[0] += 1
        entry[1] += bytes_in
        entry[2] += bytes_out
        entry[3] += seconds


def _refused(payload: Any) -> Any:  # pragma: no cover - handle() answers before calling it
    raise InvalidArgumentError("this operation is refused here")


expose(globals(), "pstrain.server", ["Status"])
