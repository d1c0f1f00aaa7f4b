"""Requests sent where the placement map says a variable lives, and sent again when it moved.

A ps that no longer holds (or does not hold yet) a variable a request names refuses the
whole request, applying nothing, with its newest map
(:class:`~pstrain.errors.PlacementChangedError`). :func:`routed` groups a request's items
by the ps holding them, sends one request per ps, and sends a refused group again by the
newer map: only that group, so nothing is applied twice. When the refusing ps knows no
newer map (the variables are between the two steps of a move, a few milliseconds), it
waits a little before asking again. A ps that cannot be reached may have left the job
(drained, then stopped) before this process learnt the map that says so: the newest map
is asked of the other ps, and the group is sent again if its variables are elsewhere now
(otherwise the error is the caller's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._base.errors import PlacementChangedError, UnavailableError
from .._base.tags import one_operation
from .._formats.messages.placement_map import PlacementMap, ReadPlacement

if TYPE_CHECKING:
    from .._transport.channels import Channel, ChannelPool

__all__ = ["MAX_ATTEMPTS", "adopt_from", "ask_map", "backoff", "routed"]

T = TypeVar("T")
R = TypeVar("R")

#: How many times a group is sent again before the refusal reaches the caller.
MAX_ATTEMPTS = 60


def adopt_from(pool: ChannelPool, exc: PlacementChangedError) -> bool:
    """Route by the map ``exc`` carries, if it is newer than ``pool``'s."""
    if exc.placement is None:
        return False
    return pool.adopt(PlacementMap.from_builtins(exc.placement))


async def routed(
    pool: ChannelPool,
    items: Sequence[T],
    channel_of: Callable[[T], Hashable],
    send: Callable[[Any, list[T]], Awaitable[R]],
    resplit: Callable[[list[T]], list[T]] | None = None,
) -> list[R]:
    """``send(channel, group)`` for each group of ``items`` by ``channel_of(item)`` (the
    channel to the ps holding it), concurrently; returns every send's result. A group a
    ps refused because the placement changed is grouped and sent again (its items first
    cut again by ``resplit``, if given: a dynamic table's ids by the newer map). The
    requests are one operation of an exactly-once closure (they share its number)."""
    with one_operation():
        return await _routed(pool, items, channel_of, send, resplit, 0)


async def _routed(
    pool: ChannelPool,
    items: Sequence[T],
    channel_of: Callable[[T], Hashable],
    send: Callable[[Any, list[T]], Awaitable[R]],
    resplit: Callable[[list[T]], list[T]] | None,
    attempt: int,
) -> list[R]:
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(channel_of(item), []).append(item)
    if len(groups) == 1:
        ((channel, group),) = groups.items()
        return await _one(pool, channel, group, channel_of, send, resplit, attempt)
    results = await asyncio.gather(
        *(_one(pool, channel, group, channel_of, send, resplit, attempt) for channel, group in groups.items())
    )
    return [r for rs in results for r in rs]


async def _one(
    pool: ChannelPool,
    channel: Channel | Any,
    group: list[T],
    channel_of: Callable[[T], Hashable],
    send: Callable[[Any, list[T]], Awaitable[R]],
    resplit: Callable[[list[T]], list[T]] | None,
    attempt: int,
) -> list[R]:
    try:
        return [await send(channel, group)]
    except PlacementChangedError as exc:
        if attempt >= MAX_ATTEMPTS:
            raise
        if not adopt_from(pool, exc):  # mid-move: the map that ends it is on its way
            await backoff(attempt)
        group = resplit(group) if resplit is not None else group
    except UnavailableError:
        if attempt >= MAX_ATTEMPTS or not await ask_map(pool, channel):
            raise
        group = resplit(group) if resplit is not None else group
        if all(getattr(channel_of(item), "task", None) == channel.task for item in group):
            raise  # still there by the newest map: the ps is down, not gone
    return await _routed(pool, group, channel_of, send, resplit, attempt + 1)


async def backoff(attempt: int) -> None:
    """Wait a little before sending a refused request again, when no newer map came with the
    refusal (the variables are between the two steps of a move: a few milliseconds)."""
    await asyncio.sleep(min(0.001 * 2 ** min(attempt, 10), 0.05))


async def ask_map(pool: ChannelPool, channel: Any) -> bool:
    """``channel``'s ps cannot be reached; it may have left the job (or been lost and
    replaced): ask the other ps of the job for the newest map and route by it. A map newer
    than this process's may name ps it did not know, which may know a newer one still
    (a ps that left the job, but still runs, answers with the map it left by): every ps
    the newest map known names is asked, once. Returns whether some ps answered."""
    answered = False
    asked = {channel.task}
    while True:
        pending = [pool.channel("ps", k) for k in pool.session.routes.active()]
        pending = [other for other in pending if other.task not in asked]
        if not pending:
            return answered
        for other in pending:
            asked.add(other.task)
            try:
                reply = await other.request(ReadPlacement(), timeout=10.0)
            except UnavailableError:
                continue
            answered = True
            if pool.adopt(reply.placement):
                break  # (the ps of the newer map: asked in the next round)
