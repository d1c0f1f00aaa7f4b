"""The stream face of a server: connection sniffing, the handshake, frames.

Every accepted connection starts with a :class:`Sniffer` and is registered
with :class:`PreAuth` (a deadline, a cap). A connection that opens with
``protocol.MAGIC`` is pstrain's stream: the mutual handshake of ``auth.py``
runs on fixed-size messages before any frame is read (an unauthenticated byte
never reaches a decoder), then a :class:`StreamConnection` reads frames and
answers each request through :meth:`Listening.handle` (``_serving.ServerCore``). Anything else is
handed to aiohttp with the bytes already read (reading paused while the server sets its
HTTP face up, on the first such connection); it stays pre-auth until one of its requests
passes the bearer-token check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._base.cluster import tune_connection
from .._base.errors import ProtocolError, PstrainError
from .frames import FrameKind, FrameProtocol
from .handshake import MAGIC, MAX_PREAUTH, REJECTED, ServerHandshake

if TYPE_CHECKING:
    from .._base.tasks import TaskOwner
    from .frames import BodyBudget
    from .preauth import PreAuth

logger = logging.getLogger(__name__)


__all__ = ["Listening", "Reply", "Sniffer", "StreamConnection"]


@dataclass
class Reply:
    """What a transport sends back: a REPLY or an ERROR frame's chunks.

    ``release`` (from :class:`Pinned`) must be called once the chunks have left.
    """

    kind: FrameKind
    chunks: list[bytes | memoryview]
    release: Callable[[], None] | None = None
    status: int = 200  # for HTTP
    envelope: dict[str, Any] | None = None  # an ERROR's envelope (HTTP sends it as JSON)


class HttpFace(Protocol):
    """Where the sniffer hands a connection that is not the stream (``_serving.base``'s
    ``HttpOnDemand``)."""

    def protocol(self) -> asyncio.Protocol | None:
        """A protocol for one HTTP connection; None while the face is not set up."""

    def start(self) -> asyncio.Future[None]:
        """Set the face up (done: :meth:`protocol` answers; failed: it cannot)."""


class Listening(Protocol):
    """What the listening side needs of the server it serves (``_serving.ServerCore``)."""

    @property
    def task(self) -> str: ...

    @property
    def incarnation(self) -> str: ...

    @property
    def token_bytes(self) -> bytes | None: ...

    @property
    def answers_any_index(self) -> bool: ...

    @property
    def max_body(self) -> int: ...

    @property
    def max_backlog_bytes(self) -> int: ...

    @property
    def budget(self) -> BodyBudget: ...

    @property
    def tasks(self) -> TaskOwner: ...

    @property
    def connections(self) -> set[asyncio.BaseTransport]: ...

    def handle(
        self, op: str, body: memoryview, emit: Callable[[Any], None]
    ) -> Reply | Coroutine[Any, Any, Reply]: ...

    def error_reply(self, op: str, exc: BaseException) -> Reply: ...

    def stream_closed(self, connection: Any) -> None: ...


class StreamConnection(FrameProtocol):
    """The server end of a stream connection (after the handshake)."""

    def __init__(self, server: Listening) -> None:
        super().__init__(server.max_body, server.budget, server.max_backlog_bytes)
        self.server = server

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.transport is not None:
            self.server.connections.discard(self.transport)
        self.server.stream_closed(self)

    def oversized(self, req_id: int, op: str) -> None:
        exc = ProtocolError(
            f"request to {op!r} is larger than this server's limit of {self.server.max_body} bytes (413)"
        )
        self._send(req_id, self.server.error_reply(op, exc))

    def handle_frame(self, req_id: int, kind: FrameKind, op: str, body: memoryview) -> None:
        if kind != FrameKind.REQUEST:
            return
        reply = self.server.handle(op, body, self._emitter(req_id))
        if isinstance(reply, Reply):
            self._send(req_id, reply)
        else:
            self.server.tasks.spawn(self._send_when_done(req_id, op, reply))

    async def _send_when_done(self, req_id: int, op: str, pending: Any) -> None:
        try:
            reply = await pending
        except asyncio.CancelledError:
            self._send(
                req_id, self.server.error_reply(op, PstrainError(f"{self.server.task} is shutting down"))
            )
            raise
        self._send(req_id, reply)

    def _emitter(self, req_id: int) -> Callable[[Any], None]:
        def emit(chunks: Any) -> None:
            self.send(req_id, FrameKind.PARTIAL, "", chunks)

        emit.connection = self  # type: ignore[attr-defined]  # whose end ``stream_closed`` tells
        return emit

    def _send(self, req_id: int, reply: Reply) -> None:
        try:
            self.send(req_id, reply.kind, "", reply.chunks, on_flushed=reply.release)
        except PstrainError:
            pass  # the connection is gone; nobody to tell (send released the pins)


class Sniffer(asyncio.Protocol):
    """Decides per connection: the pstrain stream (and runs its handshake) or HTTP."""

    def __init__(self, server: Listening, preauth: PreAuth, http: HttpFace) -> None:
        self.server = server
        self.preauth = preauth
        self.http = http
        self.waiting = False  # for the HTTP face, reading paused
        self.buf = bytearray()  # bytes before we know the protocol (a few at most)
        self.transport: asyncio.Transport | None = None
        self.handshake: ServerHandshake | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(transport)
        self.preauth.add(transport)
        tune_connection(transport.get_extra_info("socket"))  # a partitioned client is noticed

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        shake = self.handshake
        if self.waiting:  # (reading is paused: what a transport had already read)
            self.buf.extend(data)
            return
        if shake is None:
            buf = self.buf
            buf.extend(data)
            if len(buf) < len(MAGIC) and MAGIC.startswith(buf):
                return  # not enough to tell yet
            if not buf.startswith(MAGIC):
                self._to_http(transport)
                return
            server = self.server
            shake = self.handshake = ServerHandshake(
                server.token_bytes, server.task, server.incarnation, any_index=server.answers_any_index
            )
            data, self.buf = bytes(buf), bytearray()
        if len(shake.buf) + len(data) > MAX_PREAUTH + 4096:
            self._reject(transport, "sent more than a handshake before authenticating", REJECTED)
            return
        out = shake.receive(data)
        if shake.rejected is not None:
            self._reject(transport, shake.rejected, out)
            return
        if out:
            transport.write(out)
        if not shake.accepted:
            return
        self.preauth.authenticated(transport)
        stream = StreamConnection(self.server)
        transport.set_protocol(stream)
        stream.connection_made(transport)
        if shake.rest:
            stream.feed(shake.rest)

    def _to_http(self, transport: asyncio.Transport) -> None:
        """Not the stream: aiohttp takes the connection (and its first bytes). It stays
        pre-auth, under the deadline, until a request passes the token check; if the
        server has not set its HTTP face up yet, the connection waits for it, reading
        paused (and is closed if that fails, or if the server stops meanwhile)."""
        proto = self.http.protocol()
        if proto is not None:
            self._hand_over(transport, proto)
            return
        self.waiting = True
        transport.pause_reading()
        self.http.start().add_done_callback(lambda started: self._http_ready(transport, started))

    def _http_ready(self, transport: asyncio.Transport, started: asyncio.Future[None]) -> None:
        failed = started.cancelled() or started.exception() is not None
        if transport.is_closing():
            return
        proto = None if failed else self.http.protocol()
        if proto is None:
            transport.close()  # (the server logged why)
            return
        self.waiting = False
        self._hand_over(transport, proto)
        transport.resume_reading()

    def _hand_over(self, transport: asyncio.Transport, proto: asyncio.Protocol) -> None:
        self.server.connections.discard(transport)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        data, self.buf = bytes(self.buf), bytearray()
        proto.data_received(data)

    def _reject(self, transport: asyncio.Transport, why: str, answer: bytes) -> None:
        held = self.preauth.rejections.allow()  # anyone who connects could fill the log
        if held is not None:
            logger.warning(
                "%s: rejected a stream connection from %s: %s%s",
                self.server.task,
                transport.get_extra_info("peername"),
                why,
                f" ({held} more rejected since the last such line)" if held else "",
            )
        transport.write(answer)
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server.connections.discard(self.transport)
            self.preauth.authenticated(self.transport)  # no longer waiting either way
