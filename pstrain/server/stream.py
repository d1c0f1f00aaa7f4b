"""The stream face of a server: connection sniffing, the handshake, frames.

Every accepted connection starts with a :class:`Sniffer`. A connection that
opens with ``protocol.MAGIC`` is pstrain's stream: its token is checked in
constant time before any frame is read (an unauthenticated byte never
reaches a decoder), then a :class:`StreamConnection` reads frames and answers
each request through :meth:`ServerCore.handle`. Anything else is handed to
aiohttp with the bytes already read.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError, PstrainError
from ..protocol import ACCEPTED, HANDSHAKE, MAGIC, REJECTED, FrameKind, FrameProtocol
from .core import Reply

if TYPE_CHECKING:
    from .core import ServerCore

logger = logging.getLogger(__name__)

__all__ = ["Sniffer", "StreamConnection"]


class StreamConnection(FrameProtocol):
    """The server end of a stream connection (after the handshake)."""

    def __init__(self, server: ServerCore) -> None:
        super().__init__(server.max_body)
        self.server = server

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.transport is not None:
            self.server.connections.discard(self.transport)

    def oversized(self, req_id: int, op: str) -> None:
        exc = ProtocolError(f"request to {op!r} is larger than this server's limit of "
                            f"{self.server.max_body} bytes (413)")
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
            self._send(req_id, self.server.error_reply(
                op, PstrainError(f"{self.server.task} is shutting down")))
            raise
        self._send(req_id, reply)

    def _emitter(self, req_id: int) -> Callable[[Any], None]:
        def emit(chunks: Any) -> None:
            self.send(req_id, FrameKind.PARTIAL, "", chunks)

        return emit

    def _send(self, req_id: int, reply: Reply) -> None:
        try:
            self.send(req_id, reply.kind, "", reply.chunks, on_flushed=reply.release)
        except PstrainError:
            pass  # the connection is gone; nobody to tell (send released the pins)


class Sniffer(asyncio.Protocol):
    """Decides per connection: the pstrain stream or HTTP."""

    def __init__(self, server: ServerCore, http_factory: Callable[[], asyncio.Protocol]) -> None:
        self.server = server
        self.http_factory = http_factory
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        buf = self.buf
        transport = self.transport
        assert transport is not None
        if len(buf) < len(MAGIC) and MAGIC.startswith(buf):
            return  # not enough to tell yet
        if not buf.startswith(MAGIC):
            self.server.connections.discard(transport)
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
        expected = self.server.token_bytes
        if expected is not None and not hmac.compare_digest(token, expected):
            logger.warning("%s: rejected a stream connection from %s: wrong or missing token",
                           self.server.task, transport.get_extra_info("peername"))
            transport.write(MAGIC + REJECTED)
            transport.close()
            return
        transport.write(MAGIC + ACCEPTED)
        stream = StreamConnection(self.server)
        transport.set_protocol(stream)
        stream.connection_made(transport)
        rest = buf[head + token_len:]
        self.buf = b""
        if rest:
            stream.feed(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server.connections.discard(self.transport)
