"""Connections that have not authenticated yet: a deadline each, and a cap.

Before its handshake (the stream) or its first request with the right token
(HTTP), a connection costs the server a descriptor and a few bytes, and
nothing else happens: no decoder, no handler. :class:`PreAuth` bounds how
long and how many: each waits at most ``timeout_s``, and at the cap the
oldest one is dropped to make room.
"""

from __future__ import annotations

import asyncio

__all__ = ["PreAuth"]


class PreAuth:
    """Connections that have not authenticated yet: each has a deadline, and there is a cap.

    At the cap, the *oldest* waiting connection is dropped to make room, so a
    legitimate client (which completes the handshake in a millisecond) gets in
    however many idle connections an attacker holds; those it keeps open cost
    at most ``cap`` descriptors and are closed after ``timeout_s``.
    """

    def __init__(self, cap: int, timeout_s: float) -> None:
        self.cap = cap
        self.timeout_s = timeout_s
        self._waiting: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}
        self.expired = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, transport: asyncio.BaseTransport) -> None:
        while len(self._waiting) >= self.cap:
            oldest = next(iter(self._waiting))
            self.evicted += 1
            self._drop(oldest)
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(self.timeout_s, self._expire, transport)

    def authenticated(self, transport: asyncio.BaseTransport) -> None:
        handle = self._waiting.pop(transport, None)
        if handle is not None:
            handle.cancel()

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        if transport in self._waiting:
            self.expired += 1
            self._drop(transport)

    def _drop(self, transport: asyncio.BaseTransport) -> None:
        handle = self._waiting.pop(transport, None)
        if handle is not None:
            handle.cancel()
        if not transport.is_closing():
            transport.abort()  # type: ignore[attr-defined]

    def close(self) -> None:
        for transport in list(self._waiting):
            self._drop(transport)
