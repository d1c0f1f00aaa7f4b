"""The client end of one stream connection: the handshake, then frames matched to the
calls of its :class:`~pstrain._transport.channels.Channel` by request id."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, Protocol

from .._base.errors import (
    AuthenticationError,
    DeadlineExceededError,
    ProtocolError,
    PstrainError,
    UnavailableError,
    WrongTaskError,
)
from .frames import FrameKind, FrameProtocol
from .handshake import ClientHandshake, HandshakeFailed


class Channel(Protocol):
    """What a connection needs of its channel (``rpc.Channel``)."""

    task: str
    address: str
    max_body: int
    token_bytes: bytes | None
    peer: str | None

    def connection_lost(self, proto: ClientProtocol) -> None: ...


__all__ = ["ClientProtocol", "cluster_entry", "expire", "foreign_server", "ps_advice"]


def _target(task: str) -> str:
    """What a channel tells the server it means to reach: a task's name, or "" (any task)
    for a channel named otherwise (a tool that dials an address, not a task)."""
    return task if _TASK_NAME.fullmatch(task) else ""


_TASK_NAME = re.compile(r"/job:[a-z]+/replica:0/task:[0-9]+")


def foreign_server(channel: Channel, first: bytes) -> PstrainError:
    """The error for a server that answered the handshake with something else than pstrain."""
    where = f"{channel.task} at {channel.address}"
    if first[:1] in (b"\x15", b"\x16"):  # a TLS record: alert or handshake
        return AuthenticationError(
            f"{where} speaks TLS and this client does not: give the coordinator the cluster's "
            "TLS settings (the resolver's ssl_context, or --tls-ca)",
            task=channel.task,
        )
    return ProtocolError(
        f"{where} is not a pstrain server (it answered {first[:32]!r}): check the cluster's "
        "addresses (TF_CONFIG / PSTRAIN_CONFIG)",
        task=channel.task,
    )


class ClientProtocol(FrameProtocol):
    """The client end of a stream: the mutual handshake (``handshake.py``), then frames."""

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel.max_body)
        self.channel = channel
        self.pending: dict[int, asyncio.Future[tuple[FrameKind, memoryview]]] = {}
        self.partials: dict[int, Callable[[memoryview], None]] = {}
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost_exc: BaseException | None = None
        self.shake = ClientHandshake(channel.token_bytes, _target(channel.task))
        self.received = 0  # bytes the server sent during the handshake

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.write(self.shake.hello())  # type: ignore[attr-defined]

    def buffer_updated(self, nbytes: int) -> None:
        if self.handshake.done():
            super().buffer_updated(nbytes)
            return
        # Handshake bytes land in the staging buffer but are not kept there: the machine
        # takes them, and only what follows the handshake becomes frames.
        data = bytes(self._stage[self._end : self._end + nbytes])
        self.received += nbytes
        try:
            out = self.shake.receive(data)
        except HandshakeFailed as exc:
            self._fail_handshake(self._refusal(exc))
            return
        if out:
            assert self.transport is not None
            self.transport.write(out)
        if not self.shake.done:
            return
        self.channel.peer = self.shake.identity
        self.handshake.set_result(None)
        if self.shake.rest:
            self.feed(self.shake.rest)

    def _refusal(self, exc: HandshakeFailed) -> PstrainError:
        ch = self.channel
        where = f"{ch.task} at {ch.address}"
        if exc.kind == "foreign":
            return foreign_server(ch, exc.first)
        if exc.kind == "wrong_task":
            return WrongTaskError(
                f"the task at {ch.address} is {exc.actual}, not {ch.task}: the cluster spec does "
                "not match the running tasks (TF_CONFIG / PSTRAIN_CONFIG, or the cluster file)",
                actual=exc.actual,
                task=ch.task,
            )
        if exc.kind == "impostor":
            return AuthenticationError(
                f"{ch.address} proved the cluster token but answered as {exc.actual}, not "
                f"{ch.task}: the connection was relayed to another task, or the cluster spec "
                "does not match the running tasks",
                task=ch.task,
            )
        if exc.kind == "unproven":
            return AuthenticationError(
                f"{where} could not prove it knows the cluster token: it is not a task of this "
                "cluster, or it has another token (set the same PSTRAIN_TOKEN / --token-file on "
                "every task)",
                task=ch.task,
            )
        return AuthenticationError(
            f"{where} rejected the cluster token (set the same PSTRAIN_TOKEN / --token-file on every task)",
            task=ch.task,
        )

    def _fail_handshake(self, exc: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def handle_frame(self, req_id: int, kind: FrameKind, op: str, body: memoryview) -> None:
        if kind == FrameKind.PARTIAL:
            on_partial = self.partials.get(req_id)
            if on_partial is not None:
                try:
                    on_partial(body)
                except Exception as exc:  # a part that cannot be taken fails its call, not the connection
                    self._fail_call(req_id, exc)
            return
        self.partials.pop(req_id, None)
        fut = self.pending.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_result((kind, body))

    def oversized(self, req_id: int, op: str) -> None:
        """A reply (or a part of one) over this client's ``max_body`` was skipped: the call
        fails now, saying so, rather than wait for an answer that will not come."""
        self._fail_call(
            req_id,
            ProtocolError(
                f"a reply of {self.channel.task} is larger than this process's "
                f"limit of {self.channel.max_body} bytes for one message: ask for less in one "
                "call (read a variable's parts, or a table's rows, apart; return less from a "
                "closure)",
                task=self.channel.task,
            ),
        )

    def _fail_call(self, req_id: int, exc: BaseException) -> None:
        """Call ``req_id`` fails with ``exc`` (a pstrain error; anything else is the peer's
        malformed reply); the rest of its reply, if any comes, is dropped."""
        if not isinstance(exc, PstrainError):
            exc = ProtocolError(
                f"a reply of {self.channel.task} could not be taken: {type(exc).__name__}: {exc}",
                task=self.channel.task,
            )
        self.partials.pop(req_id, None)
        fut = self.pending.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.channel.connection_lost(self)
        err = UnavailableError(
            f"connection to {self.channel.task} at {self.channel.address} was lost"
            + (f": {exc}" if exc else "")
            + ps_advice(self.channel.task),
            task=self.channel.task,
        )
        self.lost_exc = self.lost_exc or err
        if not self.handshake.done():
            self.handshake.set_exception(err)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()
        self.partials.clear()


def cluster_entry(task: str, address: str) -> str:
    """Where ``task``'s address comes from, for an error about reaching it: its entry in the
    cluster configuration (``cluster["ps"][0] = "host:port"``)."""
    m = re.fullmatch(r"/job:([^/]+)/replica:[0-9]+/task:([0-9]+)", task)
    entry = f'cluster["{m.group(1)}"][{m.group(2)}]' if m else f"the entry of {task}"
    return (
        f'{entry} = "{address}" in the cluster configuration (the cluster file, PSTRAIN_CONFIG or TF_CONFIG)'
    )


def ps_advice(task: str) -> str:
    """What to do when a ps cannot be reached (said in the error a closure gets)."""
    if "/job:ps/" not in task:
        return ""
    return (
        ". If the ps restarted, its variables are lost: the coordinator's join() says so, "
        "and the latest checkpoint must be restored; if it answers again (a partition), "
        "schedule the failed work again"
    )


def expire(fut: asyncio.Future[Any], task: str, op: str, timeout: float) -> None:
    """A call's deadline passed: fail its future (if no reply came first)."""
    if not fut.done():
        fut.set_exception(
            DeadlineExceededError(f"{task} did not answer {op!r} within {timeout:g} s", task=task)
        )
