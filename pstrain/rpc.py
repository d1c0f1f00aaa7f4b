"""Channels between tasks: framing, the multiplexed stream, and the client side.

Every server answers on one port two ways (see ``server/base.py``):

* HTTP/1.1 (aiohttp): ``POST /v1/<op>`` with an ``application/x-pstrain`` body
  (``wire.py``) and ``Authorization: Bearer <token>``. Simple to reach with
  any HTTP client; costs ~100-200 us of CPU per request.
* The *stream*: a connection that opens with ``MAGIC`` and the token, after
  which both sides exchange frames multiplexed by request id. It carries the
  same operations and bodies at a fifth of the CPU per message, and receives
  large bodies straight into their final buffer (``BufferedProtocol``), which
  is what lets a 64 MiB tensor move near the speed of raw TCP.

A frame is ``FRAME`` (request id, kind, flags, op length, body length), the
op name, then the body. The token is checked (constant time) before any frame
is read, so an unauthenticated peer never reaches a decoder or unpickler.

Foreign exceptions become pstrain errors here: a refused or reset connection
is :class:`~pstrain.errors.UnavailableError` naming the task.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl as ssl_module
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import wire
from .cluster import ClusterSpec, parse_address, task_name
from .errors import (
    AuthenticationError,
    DeadlineExceededError,
    ProtocolError,
    PstrainError,
    UnavailableError,
    from_envelope,
)

logger = logging.getLogger(__name__)

__all__ = ["Channel", "Peers"]

MAGIC = b"PSTRAIN1"
HANDSHAKE = struct.Struct("<H")  # token length, after MAGIC
FRAME = struct.Struct("<QBBHQ")  # request id, kind, flags, op length, body length
REQUEST, REPLY, ERROR, PARTIAL = 1, 2, 3, 4
ACCEPTED, REJECTED = b"\x00", b"\x01"

#: Bodies above this size are received straight into their own buffer.
DIRECT_BODY = 64 << 10
#: Default largest body a server or client accepts.
DEFAULT_MAX_BODY = 2 << 30
CONTENT_TYPE = "application/x-pstrain"


class FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames; small ones through a staging buffer, large ones in place.

    Subclasses implement :meth:`handle_frame`. Bodies of large frames arrive
    in a ``bytearray`` of their own, so arrays decoded from them are writable
    and never copied again.
    """

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self._stage = bytearray(256 << 10)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self._direct: np.ndarray | None = None
        self._direct_view: memoryview | None = None
        self._direct_pos = 0
        self._direct_meta: tuple[int, int, str] = (0, 0, "")
        self._flush_waiters: list[Callable[[], None]] = []

    # -- asyncio.BufferedProtocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # high=0: pause_writing/resume_writing tell exactly when the buffer is empty,
        # which is when pinned arrays may change again.
        transport.set_write_buffer_limits(high=0)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._skip_left:
            return self._scratch()[:min(self._skip_left, 1 << 20)]
        if self._direct_view is not None:
            return self._direct_view[self._direct_pos:]
        if self._end == len(self._stage):
            self._compact()
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._skip_left:
            self._skip_left -= nbytes
            if not self._skip_left:
                self.oversized(self._skip_meta[0], self._skip_meta[1])
            return
        if self._direct_view is not None:
            self._direct_pos += nbytes
            if self._direct_pos == len(self._direct_view):
                body = self._direct
                req_id, kind, op = self._direct_meta
                self._direct = self._direct_view = None
                self.handle_frame(req_id, kind, op, memoryview(body))  # type: ignore[arg-type]
            return
        self._end += nbytes
        self._parse()

    def feed(self, data: bytes) -> None:
        """Feed bytes that arrived before this protocol took the transport."""
        view = memoryview(data)
        while view.nbytes:
            buf = self.get_buffer(-1)
            n = min(buf.nbytes, view.nbytes)
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)

    def resume_writing(self) -> None:
        if self.transport is not None and self.transport.get_write_buffer_size() == 0:
            self._run_flush_waiters()

    def connection_lost(self, exc: Exception | None) -> None:
        self._run_flush_waiters()

    # -- framing -------------------------------------------------------------------
    def _compact(self) -> None:
        remaining = self._end - self._start
        if self._start:
            self._stage[:remaining] = self._stage[self._start:self._end]
        self._start, self._end = 0, remaining
        if remaining == len(self._stage):  # a header bigger than the stage: grow it
            self._stage.extend(bytes(len(self._stage)))
            self._view = memoryview(self._stage)

    def _parse(self) -> None:
        stage = self._stage
        while True:
            avail = self._end - self._start
            if avail < FRAME.size:
                break
            start = self._start
            req_id, kind, _flags, op_len, body_len = FRAME.unpack_from(stage, start)
            head = FRAME.size + op_len
            if avail < head:
                break
            op = stage[start + FRAME.size:start + head].decode("utf-8", "replace")
            if body_len > self.max_body:
                # Oversized: discard the body as it arrives; the connection stays usable.
                have = min(avail - head, body_len)
                self._start = start + head + have
                if have == body_len:
                    self.oversized(req_id, op)
                    continue
                self._skip_left = body_len - have
                self._skip_meta = (req_id, op)
                break
            if body_len >= DIRECT_BODY:
                # Large: receive the rest straight into the body's own buffer.
                have = min(avail - head, body_len)
                body = np.empty(body_len, np.uint8)  # unlike bytearray(n): no memset
                body[:have] = np.frombuffer(stage, np.uint8, have, start + head)
                self._start = start + head + have
                if have == body_len:
                    self.handle_frame(req_id, kind, op, memoryview(body))
                    continue
                self._direct = body
                self._direct_view = memoryview(body)
                self._direct_pos = have
                self._direct_meta = (req_id, kind, op)
                break
            if avail < head + body_len:
                if head + body_len > len(stage) - start:
                    self._compact()
                break
            body = stage[start + head:start + head + body_len]  # a bytearray: writable arrays
            self._start = start + head + body_len
            self.handle_frame(req_id, kind, op, memoryview(body))
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > len(stage) // 2:
            self._compact()

    _skip_left = 0
    _skip_meta: tuple[int, str] = (0, "")
    _scratch_buf: memoryview | None = None

    def _scratch(self) -> memoryview:
        if self._scratch_buf is None:
            self._scratch_buf = memoryview(bytearray(1 << 20))
        return self._scratch_buf

    def handle_frame(self, req_id: int, kind: int, op: str, body: memoryview) -> None:
        raise NotImplementedError  # pragma: no cover - abstract

    def oversized(self, req_id: int, op: str) -> None:
        """A frame over ``max_body`` was skipped."""

    # -- sending -------------------------------------------------------------------
    def send(self, req_id: int, kind: int, op: str, chunks: Sequence[bytes | memoryview],
             on_flushed: Callable[[], None] | None = None) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            if on_flushed is not None:
                on_flushed()
            raise UnavailableError("connection closed")
        op_bytes = op.encode()
        size = wire.body_size(chunks)
        first = FRAME.pack(req_id, kind, 0, len(op_bytes), size) + op_bytes
        if len(chunks) == 1:
            transport.write(first + chunks[0])  # type: ignore[operator]
        else:
            transport.writelines([first, *chunks])
        if on_flushed is not None:
            if transport.get_write_buffer_size() == 0:
                on_flushed()
            else:
                self._flush_waiters.append(on_flushed)

    def _run_flush_waiters(self) -> None:
        waiters, self._flush_waiters = self._flush_waiters, []
        for cb in waiters:
            cb()


class _ClientProtocol(FrameProtocol):
    def __init__(self, channel: Channel) -> None:
        super().__init__(channel.max_body)
        self.channel = channel
        self.pending: dict[int, asyncio.Future[tuple[int, memoryview]]] = {}
        self.partials: dict[int, Callable[[memoryview], None]] = {}
        self.handshake: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.lost_exc: BaseException | None = None

    def buffer_updated(self, nbytes: int) -> None:
        if not self.handshake.done():
            self._end += nbytes
            if self._end - self._start < len(MAGIC) + 1:
                return
            reply = bytes(self._stage[:len(MAGIC) + 1])
            self._start += len(MAGIC) + 1
            self.handshake.set_result(reply == MAGIC + ACCEPTED)
            self._parse()
            return
        super().buffer_updated(nbytes)

    def handle_frame(self, req_id: int, kind: int, op: str, body: memoryview) -> None:
        if kind == PARTIAL:
            on_partial = self.partials.get(req_id)
            if on_partial is not None:
                on_partial(body)
            return
        self.partials.pop(req_id, None)
        fut = self.pending.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_result((kind, body))

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.channel._lost(self)
        err = UnavailableError(
            f"connection to {self.channel.task} at {self.channel.address} was lost"
            + (f": {exc}" if exc else ""), task=self.channel.task)
        self.lost_exc = err
        if not self.handshake.done():
            self.handshake.set_exception(err)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()
        self.partials.clear()


class Channel:
    """One multiplexed stream connection to one task, for the loop that made it.

    >>> # ch = Channel("127.0.0.1:2222", token="s3cret", task="/job:ps/replica:0/task:0")
    >>> # await ch.call("vars/list", {})
    """

    _ids = itertools.count(1)

    def __init__(self, address: str, *, token: str | None, task: str,
                 ssl_context: ssl_module.SSLContext | None = None,
                 max_body: int = DEFAULT_MAX_BODY, connect_timeout: float = 10.0) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.token = token
        self.task = task
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        self._proto: _ClientProtocol | None = None
        self._connecting: asyncio.Future[_ClientProtocol] | None = None
        self.closed = False

    def _lost(self, proto: _ClientProtocol) -> None:
        if self._proto is proto:
            self._proto = None

    async def _connect(self) -> _ClientProtocol:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(loop.create_connection(
                lambda: _ClientProtocol(self), self.host, self.port, ssl=self.ssl_context,
                server_hostname=self.host if self.ssl_context else None), self.connect_timeout)
        except asyncio.TimeoutError as exc:
            raise UnavailableError(
                f"{self.task} at {self.address} did not accept a connection within "
                f"{self.connect_timeout:g} s", task=self.task) from exc
        except ssl_module.SSLError as exc:
            raise AuthenticationError(
                f"TLS handshake with {self.task} at {self.address} failed: {exc}",
                task=self.task) from exc
        except OSError as exc:
            raise UnavailableError(
                f"{self.task} at {self.address} cannot be reached: {exc.strerror or exc}",
                task=self.task) from exc
        token = (self.token or "").encode()
        assert proto.transport is not None
        proto.transport.write(MAGIC + HANDSHAKE.pack(len(token)) + token)
        try:
            accepted = await asyncio.wait_for(asyncio.shield(proto.handshake), self.connect_timeout)
        except asyncio.TimeoutError as exc:
            proto.transport.close()
            raise UnavailableError(f"{self.task} at {self.address} did not answer the handshake",
                                   task=self.task) from exc
        if not accepted:
            proto.transport.close()
            raise AuthenticationError(
                f"{self.task} at {self.address} rejected the cluster token "
                "(set the same PSTRAIN_TOKEN / --token-file on every task)", task=self.task)
        return proto

    async def connected(self) -> _ClientProtocol:
        proto = self._proto
        if proto is not None:
            return proto
        if self.closed:
            raise UnavailableError(f"channel to {self.task} is closed", task=self.task)
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        fut = self._connecting
        try:
            proto = await asyncio.shield(fut)
        finally:
            if self._connecting is fut and fut.done():
                self._connecting = None
        if proto.lost_exc is None:
            self._proto = proto
        return proto

    async def call(self, op: str, payload: Any = None, *, pickle: bool = False,
                   timeout: float | None = None) -> Any:
        """Send ``payload`` to ``op`` and return the decoded reply.

        ``pickle`` allows pickled objects both ways (only for peers that run
        code: workers, and the ps's ``extended.update``).
        """
        chunks = wire.encode_body(payload, allow_pickle=pickle)
        kind, body = await self.call_raw(op, chunks, timeout=timeout)
        return self.decode_reply(kind, body, pickle=pickle)

    def decode_reply(self, kind: int, body: memoryview, *, pickle: bool = False) -> Any:
        if kind == REPLY:
            return wire.decode_body(body, allow_pickle=pickle)
        envelope = wire.decode_body(body)
        if not isinstance(envelope, dict):
            raise ProtocolError(f"malformed error reply from {self.task}")
        envelope.setdefault("task", self.task)
        raise from_envelope(envelope)

    async def call_stream(self, op: str, payload: Any, on_partial: Callable[[Any], None], *,
                          pickle: bool = False, timeout: float | None = None) -> Any:
        """Like :meth:`call`, and ``on_partial(obj)`` for each partial reply before the last."""
        chunks = wire.encode_body(payload, allow_pickle=pickle)

        def partial(body: memoryview) -> None:
            on_partial(wire.decode_body(body, allow_pickle=pickle))

        kind, body = await self.call_raw(op, chunks, timeout=timeout, on_partial=partial)
        return self.decode_reply(kind, body, pickle=pickle)

    async def call_raw(self, op: str, chunks: Sequence[bytes | memoryview], *,
                       timeout: float | None = None,
                       on_partial: Callable[[memoryview], None] | None = None
                       ) -> tuple[int, memoryview]:
        proto = self._proto or await self.connected()
        loop = asyncio.get_running_loop()
        req_id = next(self._ids)
        fut: asyncio.Future[tuple[int, memoryview]] = loop.create_future()
        proto.pending[req_id] = fut
        if on_partial is not None:
            proto.partials[req_id] = on_partial
        try:
            proto.send(req_id, REQUEST, op, chunks)
        except UnavailableError:
            proto.pending.pop(req_id, None)
            proto.partials.pop(req_id, None)
            raise UnavailableError(f"connection to {self.task} at {self.address} is closed",
                                   task=self.task) from None
        if timeout is None:
            return await fut
        handle = loop.call_later(timeout, _expire, fut, self.task, op, timeout)
        try:
            return await fut
        finally:
            handle.cancel()
            proto.pending.pop(req_id, None)
            proto.partials.pop(req_id, None)

    async def close(self) -> None:
        self.closed = True
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()


def _expire(fut: asyncio.Future[Any], task: str, op: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(DeadlineExceededError(
            f"{task} did not answer {op!r} within {timeout:g} s", task=task))


class Peers:
    """The channels of one process to the tasks of a cluster, one set per loop.

    Channels are bound to the event loop that opened them; a process with two
    loops (a worker serves on one and runs closures on the other) gets two
    sets from the same :class:`Peers`.
    """

    def __init__(self, cluster_spec: ClusterSpec, token: str | None, *,
                 ssl_context: ssl_module.SSLContext | None = None,
                 max_body: int = DEFAULT_MAX_BODY, connect_timeout: float = 10.0) -> None:
        self.cluster_spec = cluster_spec
        self.token = token
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        self._channels: dict[tuple[int, str, int], Channel] = {}
        self._loops: dict[int, asyncio.AbstractEventLoop] = {}
        _all_peers.add(self)

    def channel(self, job: str, index: int) -> Channel:
        loop = asyncio.get_running_loop()
        key = (id(loop), job, index)
        ch = self._channels.get(key)
        if ch is None or ch.closed:
            if self._loops.get(id(loop)) is not loop:  # a new loop reusing an id
                for k in [k for k in self._channels if k[0] == id(loop)]:
                    del self._channels[k]
                self._loops[id(loop)] = loop
            ch = Channel(self.cluster_spec.task_address(job, index), token=self.token,
                         task=task_name(job, index), ssl_context=self.ssl_context,
                         max_body=self.max_body, connect_timeout=self.connect_timeout)
            self._channels[key] = ch
        return ch

    async def close(self) -> None:
        """Close the channels opened on the running loop."""
        loop_id = id(asyncio.get_running_loop())
        for key in [k for k in self._channels if k[0] == loop_id]:
            await self._channels.pop(key).close()


_default_peers: Peers | None = None
_all_peers: weakref.WeakSet[Peers] = weakref.WeakSet()


async def close_loop_channels() -> None:
    """Close every channel opened on the running loop (``pstrain.run`` does this at the end)."""
    for peers in list(_all_peers):
        await peers.close()


def set_default_peers(peers: Peers | None) -> None:
    """Make ``peers`` the channels that unpickled variable handles bind to."""
    global _default_peers
    _default_peers = peers


def default_peers() -> Peers:
    if _default_peers is None:
        raise PstrainError(
            "no cluster is known in this process: create a ParameterServerStrategy first "
            "(variable handles bind to its channels)")
    return _default_peers
