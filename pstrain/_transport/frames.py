"""The stream protocol shared by pstrain's clients and servers: handshake and frames.

A connection opens with ``MAGIC`` and the mutual challenge-response handshake
of ``auth.py`` (its two ends: ``handshake.py``); then both sides exchange
*frames* multiplexed by request id::

    FRAME = u64 request id | u8 kind | u8 flags | u16 op length | u64 body length
    op (utf-8) | body (a ``wire`` body)

``kind`` is a :class:`FrameKind`: a REQUEST names an op; a REPLY or ERROR
ends it; PARTIAL frames (streamed results) may come before the end.

:class:`FrameProtocol` reads frames with no copy for large bodies: a body at
least ``DIRECT_BODY`` long is received straight into a buffer of its own
(``asyncio.BufferedProtocol``), so arrays decoded from it are writable and
never copied again. A body over the receiver's limit is skipped as it
arrives and reported with :meth:`FrameProtocol.oversized`; the connection
stays usable. No decoding happens here.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import struct
from collections.abc import Callable, Sequence

import numpy as np

from .._base.errors import UnavailableError
from . import wire
from .handshake import ACCEPTED, MAGIC, REJECTED

__all__ = [
    "ACCEPTED",
    "CONTENT_TYPE",
    "DEFAULT_MAX_BODY",
    "DIRECT_BODY",
    "FRAME",
    "MAGIC",
    "REJECTED",
    "FrameKind",
    "FrameProtocol",
]

FRAME = struct.Struct("<QBBHQ")  # request id, kind, flags, op length, body length

#: Bodies above this size are received straight into their own buffer.
DIRECT_BODY = 64 << 10
#: A large body's first buffer (it doubles as bytes arrive, up to the body's size).
FIRST_BODY_BUFFER = 4 << 20
#: Default largest body a server or client accepts.
DEFAULT_MAX_BODY = 2 << 30
#: The HTTP content type of a ``wire`` body.
CONTENT_TYPE = "application/x-pstrain"


class FrameKind(enum.IntEnum):
    """What a frame is."""

    REQUEST = 1
    REPLY = 2
    ERROR = 3
    PARTIAL = 4


class BodyBudget:
    """Bytes of large bodies being received at once, across a server's connections.

    Charged with the buffers large bodies are received into, which grow as the bytes
    arrive (``FIRST_BODY_BUFFER``, then doubling up to the body's size), never by what a
    frame header claims: a header that claims 2 GiB and sends nothing reserves 4 MiB of
    address space. A buffer that would take the bytes held past ``limit`` drops the
    connection that sent it (the others go on).

    >>> b = BodyBudget(100)
    >>> b.reserve(60), b.reserve(60), b.release(60), b.reserve(60)
    (True, False, None, True)
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def reserve(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)


#: A large body must arrive at least this fast (bytes/s), and within at least this long.
MIN_BODY_RATE = 4 << 20
MIN_BODY_DEADLINE_S = 15.0


class FrameProtocol(asyncio.BufferedProtocol, abc.ABC):
    """Reads frames; small ones through a staging buffer, large ones in place.

    Subclasses implement :meth:`handle_frame`. Bodies of large frames arrive
    in a buffer of their own, so arrays decoded from them are writable and
    never copied again. With a ``budget`` (servers), a large body's bytes are
    charged to it as they arrive, and the body must keep arriving (at least
    ``MIN_BODY_RATE`` over each ``MIN_BODY_DEADLINE_S``), else the connection is
    dropped. With
    ``max_backlog``, reading stops while more than that many reply bytes wait
    to be sent (a peer that does not read its replies cannot grow our memory).
    """

    def __init__(
        self, max_body: int, budget: BodyBudget | None = None, max_backlog: int | None = None
    ) -> None:
        self.max_body = max_body
        self.budget = budget
        self.max_backlog = max_backlog
        self._reads_paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self._stage = bytearray(256 << 10)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self._direct: np.ndarray | None = None
        self._direct_view: memoryview | None = None
        self._direct_pos = 0
        self._direct_meta: tuple[int, FrameKind, str] = (0, FrameKind.REQUEST, "")
        self._flush_waiters: list[Callable[[], None]] = []

    # -- asyncio.BufferedProtocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # high=0: pause_writing/resume_writing tell exactly when the buffer is empty,
        # which is when pinned arrays may change again.
        transport.set_write_buffer_limits(high=0)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dropped:
            return self._scratch()
        if self._skip_left:
            return self._scratch()[: min(self._skip_left, 1 << 20)]
        if self._direct_view is not None:
            if self._direct_pos == len(self._direct_view):  # bytes are there: room for them
                self._grow()
                if self._dropped:  # over the budget
                    return self._scratch()
            return self._direct_view[self._direct_pos :]
        if self._end == len(self._stage):
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._dropped:  # what a dropped connection still sent is not read
            return
        if self._skip_left:
            self._skip_left -= nbytes
            if not self._skip_left:
                self.oversized(self._skip_meta[0], self._skip_meta[1])
            return
        if self._direct_view is not None:
            self._direct_pos += nbytes
            if self._direct_pos == self._direct_len:
                body = self._direct
                assert body is not None
                req_id, kind, op = self._direct_meta
                self._direct = self._direct_view = None
                self._end_large_body()
                self.handle_frame(req_id, kind, op, body.data)
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
            if self._reads_paused:
                self._reads_paused = False
                self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._run_flush_waiters()
        if self._direct is not None:  # a large body that never completed
            self._direct = self._direct_view = None
        self._end_large_body()

    def _grow(self) -> None:
        """The large body's buffer is full and more bytes are there to read: twice the size
        (at least ``FIRST_BODY_BUFFER``, at most the body's), its bytes copied over.
        Reserving as the bytes arrive costs at most one more copy of the body; reserving
        what a header claims let a few headers that claim 2 GiB each take a process's
        address space before a byte came."""
        old = self._direct
        assert old is not None
        capacity = min(self._direct_len, max(2 * old.size, FIRST_BODY_BUFFER))
        if not self._charge(capacity - old.size):
            return
        body = np.empty(capacity, np.uint8)
        body[: old.size] = old
        self._direct = body
        self._direct_view = body.data

    def _charge(self, nbytes: int) -> bool:
        """A large body's buffer grows by ``nbytes``: hold them against the budget, or drop
        this connection (it holds more than the server-wide budget leaves)."""
        if self.budget is None:
            return True
        if not self.budget.reserve(nbytes):
            self._dropped = True
            self._direct = self._direct_view = None
            self._end_large_body()
            if self.transport is not None:
                self.transport.abort()
            return False
        self._charged += nbytes
        return True

    def _end_large_body(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.budget is not None and self._charged:
            self.budget.release(self._charged)
        self._charged = 0

    def _check_progress(self) -> None:
        """A large body must keep arriving: at least ``MIN_BODY_RATE`` over each
        ``MIN_BODY_DEADLINE_S`` (or the rest of it), else the connection is dropped."""
        self._deadline = None
        view = self._direct_view
        if view is None or self.transport is None:
            return
        arrived = self._direct_pos - self._progress_mark
        if arrived < min(self._direct_len - self._progress_mark, MIN_BODY_RATE * MIN_BODY_DEADLINE_S):
            self.transport.abort()  # connection_lost releases what it held
            return
        self._progress_mark = self._direct_pos
        self._deadline = asyncio.get_running_loop().call_later(MIN_BODY_DEADLINE_S, self._check_progress)

    # -- framing -------------------------------------------------------------------
    def _compact(self) -> None:
        remaining = self._end - self._start
        if self._start:
            self._stage[:remaining] = self._stage[self._start : self._end]
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
            op = stage[start + FRAME.size : start + head].decode("utf-8", "replace")
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
                # Large: receive the rest straight into the body's own buffer, reserved as
                # the bytes arrive (``_grow``), never as the header claims.
                have = min(avail - head, body_len)
                # Reserved once bytes of it arrived (up to FIRST_BODY_BUFFER, so that most
                # bodies take one buffer and no copy), grown as more arrive (get_buffer): a
                # header alone reserves nothing.
                capacity = min(body_len, max(have, FIRST_BODY_BUFFER)) if have else 0
                if not self._charge(capacity):
                    return
                body = np.empty(capacity, np.uint8)  # pages touched as bytes arrive (no memset)
                body[:have] = np.frombuffer(stage, np.uint8, have, start + head)
                self._start = start + head + have
                if have == body_len:
                    self._end_large_body()
                    self.handle_frame(req_id, kind, op, body.data)
                    continue
                if self.budget is not None:
                    self._progress_mark = have
                    self._deadline = asyncio.get_running_loop().call_later(
                        MIN_BODY_DEADLINE_S, self._check_progress
                    )
                self._direct = body
                self._direct_view = body.data
                self._direct_pos = have
                self._direct_len = body_len
                self._direct_meta = (req_id, kind, op)
                break
            if avail < head + body_len:
                if head + body_len > len(stage) - start:
                    self._compact()
                break
            small = stage[start + head : start + head + body_len]  # a bytearray: writable arrays
            self._start = start + head + body_len
            self.handle_frame(req_id, kind, op, memoryview(small))
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > len(stage) // 2:
            self._compact()

    _skip_left = 0
    _dropped = False  # over the budget: aborted, nothing more is read
    _direct_len = 0  # the large body's size (its buffer grows to it as bytes arrive)
    _charged = 0  # bytes of the current large body held against the budget
    _progress_mark = 0  # where the large body was at the last progress check
    _skip_meta: tuple[int, str] = (0, "")
    _scratch_buf: memoryview | None = None

    def _scratch(self) -> memoryview:
        if self._scratch_buf is None:
            self._scratch_buf = memoryview(bytearray(1 << 20))
        return self._scratch_buf

    @abc.abstractmethod
    def handle_frame(self, req_id: int, kind: FrameKind, op: str, body: memoryview) -> None:
        """A complete frame arrived (``body`` is its own buffer for large frames)."""

    def oversized(self, req_id: int, op: str) -> None:
        """A frame over ``max_body`` (or over the budget) was skipped."""

    # -- sending -------------------------------------------------------------------
    def send(
        self,
        req_id: int,
        kind: FrameKind,
        op: str,
        chunks: Sequence[bytes | memoryview],
        on_flushed: Callable[[], None] | None = None,
    ) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            if on_flushed is not None:
                on_flushed()
            raise UnavailableError("connection closed")
        op_bytes = op.encode()
        size = wire.body_size(chunks)
        first = FRAME.pack(req_id, kind, 0, len(op_bytes), size) + op_bytes
        if len(chunks) == 1:
            transport.write(first + chunks[0])
        else:
            transport.writelines([first, *chunks])
        if (
            self.max_backlog is not None
            and not self._reads_paused
            and transport.get_write_buffer_size() > self.max_backlog
        ):
            self._reads_paused = True  # resume_writing resumes once the peer has read it all
            transport.pause_reading()
        if on_flushed is not None:
            if transport.get_write_buffer_size() == 0:
                on_flushed()
            else:
                self._flush_waiters.append(on_flushed)

    def _run_flush_waiters(self) -> None:
        waiters, self._flush_waiters = self._flush_waiters, []
        for cb in waiters:
            cb()
