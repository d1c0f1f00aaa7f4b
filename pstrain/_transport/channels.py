"""Channels: the client side of pstrain's stream protocol.

A :class:`Channel` is one multiplexed connection (``frames.py``) from this
process to one task, for the event loop that opened it; calls on it are
matched to replies by request id, so any number may be in flight. A
:class:`ChannelPool` holds the channels of one cluster, one set per loop (a
worker serves on one loop and runs closures on another).

Foreign exceptions become pstrain errors here: a refused or reset connection
is :class:`~pstrain.errors.UnavailableError` naming the task, a TLS failure
or a rejected token :class:`~pstrain.errors.AuthenticationError`.

Every channel still open on a loop is known, so :func:`close_loop_channels`
(which ``pstrain.run`` calls at the end) can close them before the loop closes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl as ssl_module
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._base.auth import normalize_token
from .._base.cluster import (
    ClusterSpec,
    local_connection,
    local_socket_name,
    parse_address,
    task_name,
    tune_connection,
)
from .._base.errors import (
    AuthenticationError,
    DeadlineExceededError,
    ProtocolError,
    PstrainError,
    UnavailableError,
    from_envelope,
    restated,
)
from .._base.exports import expose
from .._base.tasks import TaskOwner
from .._formats.messages.operations import Health, Statistics
from .._formats.messages.placement_map import PlacementMap
from .._formats.messages.records import HealthReply, Operation, R, convert_reply, sender_fields
from . import wire
from .client import ClientProtocol, cluster_entry, expire, ps_advice
from .frames import DEFAULT_MAX_BODY, FrameKind
from .session import JobSession
from .traffic import counted, counting

__all__ = ["Channel", "ChannelPool", "close_loop_channels"]

logger = logging.getLogger(__name__)
#: Handshakes ended by the server without a byte, in a row, before it is not retried.
SILENT_CLOSES = 3


#: The open channels of each loop (weakly: a channel nobody holds is already closed).
_open: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakSet[Channel]] = (
    weakref.WeakKeyDictionary()
)


class Channel:
    """One multiplexed stream connection to one task, for the loop that made it.

    Made by a :class:`ChannelPool`, or directly for one task: ``ch = Channel("127.0.0.1:2222",
    token="s3cret", task="/job:ps/replica:0/task:0")``, then ``await ch.statistics()`` (or any
    operation, typed: ``await ch.request(ListVariables())``) and ``await ch.close()``."""

    __pstrain_opaque__ = True  # a checkpoint does not walk into it (object_graph)

    _ids = itertools.count(1)

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        task: str,
        ssl_context: ssl_module.SSLContext | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        connect_timeout: float = 10.0,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.token = normalize_token(token)
        self.token_bytes = self.token.encode() if self.token else None
        self.task = task
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        #: The job's state these requests carry (its owner) and update (the pool's session
        #: when a pool opened it, else its own).
        self.session = JobSession()
        self._proto: ClientProtocol | None = None
        self._connecting: asyncio.Task[ClientProtocol] | None = None
        self._tasks = TaskOwner(f"channel to {task}")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._silent_closes = 0  # handshakes the server ended without a byte, in a row
        #: The task that answered the last handshake, with its incarnation.
        self.peer: str | None = None
        self.ever_connected = False  # False: the task may still be starting
        self.closed = False

    @property
    def owner(self) -> str | None:
        """The coordinator incarnation whose updates this channel sends: ``session.owner``
        (the name 0.1 had, kept)."""
        return self.session.owner

    @owner.setter
    def owner(self, owner: str | None) -> None:
        self.session.owner = owner

    def connection_lost(self, proto: ClientProtocol) -> None:
        """Called by the protocol: the next call reconnects."""
        if self._proto is proto:
            self._proto = None

    async def _dial(self, loop: asyncio.AbstractEventLoop) -> ClientProtocol:
        """A connection to the task: its local socket if it is on this host and listens on
        one (:func:`~pstrain._base.cluster.local_socket_name`), else TCP (with TLS if set)."""
        name = None if self.ssl_context is not None else local_socket_name(self.host, self.port)
        sock = None if name is None else local_connection(name)
        if sock is not None:
            _, proto = await loop.create_unix_connection(lambda: ClientProtocol(self), sock=sock)
            return proto
        _, proto = await loop.create_connection(
            lambda: ClientProtocol(self),
            self.host,
            self.port,
            ssl=self.ssl_context,
            server_hostname=self.host if self.ssl_context else None,
        )
        return proto

    async def _connect(self) -> ClientProtocol:
        loop = asyncio.get_running_loop()
        try:
            proto = await asyncio.wait_for(self._dial(loop), self.connect_timeout)
        except TimeoutError as exc:
            raise UnavailableError(
                f"{self.task} at {self.address} did not accept a connection within "
                f"{self.connect_timeout:g} s",
                task=self.task,
            ) from exc
        except ssl_module.SSLError as exc:
            raise self._refused(
                AuthenticationError(
                    f"TLS handshake with {self.task} at {self.address} failed: {exc}. If the "
                    "cluster does not use TLS, give the coordinator no ssl_context; if it does, "
                    "give it the cluster's CA (--tls-ca)",
                    task=self.task,
                )
            ) from exc
        except OSError as exc:
            advice = (
                ps_advice(self.task)
                if self.ever_connected
                else (f". If it should be up, check {cluster_entry(self.task, self.address)}")
            )
            raise UnavailableError(
                f"{self.task} at {self.address} cannot be reached: {exc.strerror or exc}" + advice,
                task=self.task,
            ) from exc
        assert proto.transport is not None
        tune_connection(proto.transport.get_extra_info("socket"))
        try:
            await asyncio.wait_for(asyncio.shield(proto.handshake), self.connect_timeout)
        except TimeoutError as exc:
            proto.transport.abort()
            raise UnavailableError(
                f"{self.task} at {self.address} did not answer the handshake "
                f"within {self.connect_timeout:g} s",
                task=self.task,
            ) from exc
        except UnavailableError as exc:
            proto.transport.abort()
            if proto.received:
                raise
            # Accepted, then closed without a byte: a server shutting down does that once; a
            # TLS server given a plain handshake (or a foreign one) does it every time.
            self._silent_closes += 1
            if self._silent_closes < SILENT_CLOSES:
                raise
            raise self._refused(
                ProtocolError(
                    f"{self.task} at {self.address} closed the connection {self._silent_closes} "
                    "times in a row during the handshake without answering: it probably expects "
                    "TLS (give the coordinator the cluster's TLS settings: the resolver's "
                    "ssl_context, or --tls-ca) or is not a pstrain server",
                    task=self.task,
                )
            ) from exc
        except PstrainError as exc:  # another server, task or token answered the handshake
            proto.transport.abort()
            refusal = self._refused(exc)
            if refusal is exc:
                raise
            raise refusal from exc
        except BaseException:
            proto.transport.abort()
            raise
        self._silent_closes = 0
        self.ever_connected = True
        return proto

    def _refused(self, exc: PstrainError) -> PstrainError:
        """The error for a handshake refused with ``exc``. For a task never reached, ``exc``:
        a configuration error (another server, task or token at the address the cluster
        gives). For one this channel reached there before, the task is gone and something
        else took its address (a port taken, an address given to another machine, as a
        pod's is): it cannot be reached (``UnavailableError``), as a task that died."""
        if not self.ever_connected:
            return exc
        return UnavailableError(
            f"{self.task} answered at {self.address} before, and another server answers "
            f"there now: {exc.message}",
            task=self.task,
        )

    async def connected(self) -> ClientProtocol:
        proto = self._proto
        if proto is not None:
            return proto
        if self.closed:
            raise UnavailableError(f"channel to {self.task} is closed", task=self.task)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            _open.setdefault(self._loop, weakref.WeakSet()).add(self)
        if self._connecting is None:
            self._connecting = self._tasks.spawn(self._connect(), observed=True)
            self._connecting.add_done_callback(self._connect_ended)
        fut = self._connecting
        try:
            proto = await asyncio.shield(fut)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and not (task is not None and task.cancelling()):
                raise UnavailableError(
                    f"the connection to {self.task} at {self.address} was reset while connecting",
                    task=self.task,
                ) from None
            raise
        return proto  # kept by _connect_ended (which runs first: it was added first)

    def _connect_ended(self, fut: asyncio.Task[ClientProtocol]) -> None:
        """An attempt ended: the next call makes its own, even if this one's callers were all
        cancelled (it must not get a failure from before the task came back)."""
        if self._connecting is fut:
            self._connecting = None
        if not (self.closed or fut.cancelled()) and fut.exception() is None and fut.result().lost_exc is None:
            self._proto = self._proto or fut.result()

    async def request(
        self,
        message: Operation[R],
        *,
        timeout: float | None = None,
        on_partial: Callable[[R], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> R:
        """Send ``message`` (an operation of ``pstrain._formats.messages.operations``) and return its
        reply as the operation's declared reply class (a ProtocolError if it is not one).

        An operation carries its sender here
        (:func:`~pstrain._formats.messages.records.sender_fields`). ``on_partial(reply)`` is called
        for each partial reply of a streaming operation; ``on_sent()`` once its frame is
        written (what this connection carries next, the server reads after it).
        """
        cls = type(message)
        for field, value in sender_fields(cls, self.task, self.session.owner).items():
            setattr(message, field, value)
        op = cls.op()
        chunks = wire.encode_body(message, allow_pickle=cls.pickle)
        kept = cls.pickle_failures_kept
        partial = None
        if on_partial is not None:

            def partial(body: memoryview) -> None:
                payload = wire.decode_body(body, allow_pickle=cls.pickle, pickle_failures_kept=kept)
                on_partial(convert_reply(op, cls.reply, payload, self.task))

        kind, body = await self.call_raw(op, chunks, timeout=timeout, on_partial=partial, on_sent=on_sent)
        payload = self.decode_reply(kind, body, pickle=cls.pickle, pickle_failures_kept=kept)
        return convert_reply(op, cls.reply, payload, self.task)

    async def health(self, *, timeout: float | None = None) -> HealthReply:
        """The task's health: its status, role, index, pid, uptime and incarnation."""
        return await self.request(Health(), timeout=timeout)

    async def statistics(self, *, timeout: float | None = None) -> dict[str, Any]:
        """The task's counters (what ``pstrain status`` and ``/metrics`` show), free-form."""
        return await self.request(Statistics(), timeout=timeout)

    def decode_reply(
        self, kind: FrameKind, body: memoryview, *, pickle: bool = False, pickle_failures_kept: bool = False
    ) -> Any:
        """The payload of a REPLY, or the error an ERROR frame carries, raised."""
        if kind == FrameKind.REPLY:
            return wire.decode_body(body, allow_pickle=pickle, pickle_failures_kept=pickle_failures_kept)
        envelope = wire.decode_body(body)
        if not isinstance(envelope, dict):
            raise ProtocolError(f"malformed error reply from {self.task}")
        envelope.setdefault("task", self.task)
        raise from_envelope(envelope)

    async def call_raw(
        self,
        op: str,
        chunks: Sequence[bytes | memoryview],
        *,
        timeout: float | None = None,
        on_partial: Callable[[memoryview], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> tuple[FrameKind, memoryview]:
        proto = self._proto
        if proto is None:  # a call's deadline covers connecting too
            try:
                async with asyncio.timeout(timeout):  # (3.11's wait_for can lose a cancel)
                    proto = await self.connected()
            except TimeoutError:  # (connected() raises none of its own: only the deadline's)
                raise DeadlineExceededError(
                    f"{self.task} at {self.address} could not be reached within {timeout:g} s for {op!r}",
                    task=self.task,
                ) from None
        counters = counted(self.task, op, sum(len(c) for c in chunks)) if counting() else ()
        loop = asyncio.get_running_loop()
        req_id = next(self._ids)
        fut: asyncio.Future[tuple[FrameKind, memoryview]] = loop.create_future()
        proto.pending[req_id] = fut
        if on_partial is not None:
            proto.partials[req_id] = on_partial
        try:
            proto.send(req_id, FrameKind.REQUEST, op, chunks)
        except UnavailableError:
            proto.pending.pop(req_id, None)
            proto.partials.pop(req_id, None)
            raise UnavailableError(
                f"connection to {self.task} at {self.address} is closed", task=self.task
            ) from None
        if on_sent is not None:
            on_sent()
        if timeout is None:
            reply = await fut
        else:
            handle = loop.call_later(timeout, expire, fut, self.task, op, timeout)
            try:
                reply = await fut
            finally:
                handle.cancel()
                proto.pending.pop(req_id, None)
                proto.partials.pop(req_id, None)
        for c in counters:
            c.bytes_received += len(reply[1])
        return reply

    def reset(self) -> None:
        """Drop the connection (calls in flight fail with UnavailableError); the next call
        connects afresh. For a peer that stopped answering: a healed one is reached at once
        on a new connection, not after the old one's retransmission back-off."""
        proto = self._proto
        self._proto = None
        if proto is not None and proto.transport is not None:
            proto.transport.abort()
        connecting, self._connecting = self._connecting, None
        if connecting is not None:  # a connect begun during the partition: its SYNs back off
            connecting.cancel()

    async def close(self) -> None:
        """Close the connection; calls in flight fail with UnavailableError."""
        self.closed = True
        await self._tasks.close()
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()
        if self._loop is not None:
            channels = _open.get(self._loop)
            if channels is not None:
                channels.discard(self)


class ChannelPool:
    """The channels of one process to the tasks of a cluster, one set per event loop.

    Channels are bound to the loop that opened them; a process with two loops (a worker
    serves on one and runs closures on the other) gets two sets from the same pool.

    >>> pool = ChannelPool(ClusterSpec({"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}),
    ...                    token="s3cret")
    >>> pool.cluster_spec.num_tasks("ps")
    1
    """

    __pstrain_opaque__ = True  # a checkpoint does not walk into it (object_graph)

    def __init__(
        self,
        cluster_spec: ClusterSpec,
        token: str | None,
        *,
        ssl_context: ssl_module.SSLContext | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        connect_timeout: float = 10.0,
    ) -> None:
        self.cluster_spec = cluster_spec
        self.token = normalize_token(token)
        self.ssl_context = ssl_context
        self.max_body = max_body
        self.connect_timeout = connect_timeout
        #: The job's state: owner, fences, restored incarnations, placement map and lock.
        self.session = JobSession(cluster_spec.job_tasks("ps"))
        self._channels: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[tuple[str, int], Channel]
        ] = weakref.WeakKeyDictionary()
        # The last loop's channels: every variable operation asks, almost always from one loop.
        self._last: tuple[weakref.ref[asyncio.AbstractEventLoop], dict[tuple[str, int], Channel]] | None = (
            None
        )

    def adopt(self, placement: PlacementMap) -> bool:
        """Route by ``placement`` if it is newer than the map this pool knows (a ps that
        joined is dialled at its address from then on). Returns whether it was newer."""
        if placement.version <= self.session.routes.version:
            return False
        self.session.routes = placement
        grown = placement.grown(self.cluster_spec.job_tasks("ps"))
        if grown is not None:
            self.cluster_spec = ClusterSpec({**self.cluster_spec.as_dict(), "ps": grown})
        return True

    def channel(self, job: str, index: int) -> Channel:
        """The channel to task ``job:index`` on the running loop (made on first use)."""
        loop = asyncio.get_running_loop()
        last = self._last
        if last is not None and last[0]() is loop:
            channels = last[1]
        else:
            channels = self._channels.get(loop)  # type: ignore[assignment]
            if channels is None:
                channels = self._channels[loop] = {}
            self._last = (weakref.ref(loop), channels)
        ch = channels.get((job, index))
        if ch is None or ch.closed:
            ch = channels[(job, index)] = Channel(
                self.cluster_spec.task_address(job, index),
                token=self.token,
                task=task_name(job, index),
                ssl_context=self.ssl_context,
                max_body=self.max_body,
                connect_timeout=self.connect_timeout,
            )
            ch.session = self.session
        return ch

    async def answers(self, address: str, job: str, index: int, timeout: float, *, otherwise: str) -> None:
        """Whether the server at ``address`` answers as task ``job:index`` (the handshake
        checks the task it dialled, both ways authenticated): returns, or raises the
        :class:`PstrainError` that says why not, and ``otherwise`` (what that means: "so it
        did not join ..."). On a channel of its own, closed after."""
        task = task_name(job, index)
        channel = Channel(
            address,
            token=self.token,
            task=task,
            ssl_context=self.ssl_context,
            max_body=self.max_body,
            connect_timeout=min(self.connect_timeout, timeout),
        )
        try:
            await channel.request(Health(), timeout=timeout)
        except PstrainError as exc:
            raise restated(
                exc, f"the {job} at {address} did not answer as {task}, {otherwise}: {exc.message}"
            ) from exc
        finally:
            await channel.close()

    async def forget(self, job: str, index: int) -> None:
        """Close and drop the channels to task ``job:index`` on every loop (its address
        changed: the next ``channel()`` connects to the new one)."""
        running = asyncio.get_running_loop()
        for loop, channels in list(self._channels.items()):
            ch = channels.pop((job, index), None)
            if ch is None:
                continue
            if loop is running:
                await ch.close()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(ch.reset)

    def reset(self, job: str, index: int) -> None:
        """Drop the connections to task ``job:index`` on every loop (from any thread); the
        next calls connect afresh."""
        for loop, channels in list(self._channels.items()):
            ch = channels.get((job, index))
            if ch is not None and not loop.is_closed():
                loop.call_soon_threadsafe(ch.reset)

    async def close(self) -> None:
        """Close the channels opened on the running loop."""
        channels = self._channels.pop(asyncio.get_running_loop(), {})
        self._last = None
        for ch in channels.values():
            await ch.close()


async def close_loop_channels() -> None:
    """Close every channel still open on the running loop (``pstrain.run`` does this at the end)."""
    channels = _open.pop(asyncio.get_running_loop(), None)
    for ch in list(channels or ()):
        await ch.close()


def open_channels() -> list[Channel]:
    """The channels open on the running loop (the test cluster's leak check reads this)."""
    return list(_open.get(asyncio.get_running_loop(), ()))


expose(globals(), "pstrain.rpc")
