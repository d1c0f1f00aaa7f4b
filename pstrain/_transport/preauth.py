"""Connections that have not authenticated yet: a deadline each, and a cap.

Before its handshake (the stream) or its first request with the right token
(HTTP), a connection costs the server a descriptor and a few bytes, and
nothing else happens: no decoder, no handler. :class:`PreAuth` bounds how
long and how many: each waits at most ``timeout_s``, and at the cap the
oldest one of the busiest peer host is dropped to make room.
"""

from __future__ import annotations

import asyncio
import resource
import time

__all__ = ["PreAuth", "Throttle", "preauth_cap"]

#: Descriptors kept for everything but pre-auth connections when the cap is derived from
#: the process's limit (authenticated peers, files, the listener, the loop's own).
RESERVED_FDS = 64


def preauth_cap(wanted: int) -> int:
    """The pre-auth cap for this process: ``wanted``, but never more than half of the
    descriptors the process may open beyond ``RESERVED_FDS``, so that connections that
    never authenticate cannot take the descriptors real clients need. The soft limit is
    raised to the hard one first, where allowed.

    >>> 1 <= preauth_cap(1024) <= 1024
    True
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # not allowed here: the soft limit stands
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - RESERVED_FDS) // 2))


class Throttle:
    """At most one log line per ``every_s``; the lines held back are counted and said.

    >>> t = Throttle(60.0)
    >>> t.allow(), t.allow(), t.allow(), t.suppressed
    (0, None, None, 2)
    """

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._next = 0.0
        self.suppressed = 0

    def allow(self) -> int | None:
        """None: stay quiet (counted); else how many were held back since the last line."""
        now = time.monotonic()
        if now < self._next:
            self.suppressed += 1
            return None
        held, self.suppressed = self.suppressed, 0
        self._next = now + self.every_s
        return held


class PreAuth:
    """Connections that have not authenticated yet: each has a deadline, and there is a cap.

    At the cap, a waiting connection is dropped to make room: the oldest one of the peer
    host that holds the most. So a host that floods the server with hellos it never
    proves evicts its own connections first, and a legitimate client in the middle of a
    handshake (even a slow one, taking a second) is reached last: the cap is large
    (1,024: a pre-auth connection costs a descriptor and a few KiB), so a flood from its
    own host must hold a thousand newer connections before its turn comes. Those the
    flood keeps open cost at most ``cap`` descriptors and close after ``timeout_s``.
    """

    def __init__(self, cap: int, timeout_s: float) -> None:
        self.cap = cap
        self.timeout_s = timeout_s
        self._waiting: dict[asyncio.BaseTransport, tuple[asyncio.TimerHandle, str]] = {}
        self._by_host: dict[str, dict[asyncio.BaseTransport, None]] = {}  # oldest first
        self.expired = 0
        self.evicted = 0
        #: Rejected handshakes are logged at most once per 10 s, with a count of the rest.
        self.rejections = Throttle()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, transport: asyncio.BaseTransport) -> None:
        while len(self._waiting) >= self.cap:
            self.evicted += 1
            self._drop(self._victim())
        host = _host(transport)
        loop = asyncio.get_running_loop()
        self._waiting[transport] = (loop.call_later(self.timeout_s, self._expire, transport), host)
        self._by_host.setdefault(host, {})[transport] = None

    def _victim(self) -> asyncio.BaseTransport:
        """The oldest waiting connection of the host holding the most."""
        crowd = max(self._by_host.values(), key=len)
        return next(iter(crowd))

    def authenticated(self, transport: asyncio.BaseTransport) -> None:
        self._forget(transport)

    def _forget(self, transport: asyncio.BaseTransport) -> bool:
        entry = self._waiting.pop(transport, None)
        if entry is None:
            return False
        handle, host = entry
        handle.cancel()
        peers = self._by_host.get(host)
        if peers is not None:
            peers.pop(transport, None)
            if not peers:
                del self._by_host[host]
        return True

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        if transport in self._waiting:
            self.expired += 1
            self._drop(transport)

    def _drop(self, transport: asyncio.BaseTransport) -> None:
        self._forget(transport)
        if not transport.is_closing():
            transport.abort()  # type: ignore[attr-defined]

    def close(self) -> None:
        for transport in list(self._waiting):
            self._drop(transport)


def _host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "local" if isinstance(peer, (str, bytes)) else "?"  # a Unix socket: this host
