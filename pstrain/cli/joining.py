"""A task started with ``pstrain serve --join HOST:PORT``: it joins the job through the
coordinator's endpoint, and joins again whenever another coordinator serves there.

A coordinator started again after it was lost (on its original cluster file, at the
same endpoint address) does not know the tasks that joined the one before. So each such
task follows the coordinator it joined: every ``FOLLOW_PERIOD_S`` it asks the endpoint's
``health`` for the coordinator's incarnation, and once another one answers it joins that
coordinator as it joined the first. A worker takes a slot; a ps asks for an index, answers
to it, and joins: what moves to it then takes over what the old coordinator left there.
A coordinator that does not answer for a while (it is being restarted) is asked again; one
that took the ps out of the job (``remove_ps``) is the same coordinator, and is not asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._base.errors import PstrainError
from .._formats.messages.operations import Health
from .common import coordinator_call, join, retag_logging

__all__ = ["FOLLOW_PERIOD_S", "follow", "incarnation", "join_as"]

logger = logging.getLogger("pstrain.cli")

#: How often a task that joined asks whether its coordinator is still the one it joined.
FOLLOW_PERIOD_S = 2.0


async def incarnation(coordinator: str, token: str | None) -> str:
    """The incarnation of the coordinator serving at ``coordinator`` (new with each one)."""
    try:
        reply = await coordinator_call(coordinator, Health(), token)
    except PstrainError as exc:
        raise PstrainError(
            f"the coordinator at {coordinator} did not answer: {type(exc).__name__}: {exc}"
        ) from exc
    return str(reply.incarnation)


def join_as(
    role: str, server: Any, coordinator: str, address: str, token: str | None
) -> Callable[[], Awaitable[int]]:
    """What joins ``server`` (a ps or a worker, serving at ``address``) to the coordinator at
    ``coordinator``; returns its index there."""

    async def join_ps() -> int:
        server.answers_any_index = True  # until the coordinator gives it its index
        given = await join(coordinator, address, token, ps=True)
        server.renamed(given)
        retag_logging(f"ps:{given}")  # its log lines say what it is now
        logger.info("joining the job at %s as ps %d", coordinator, given)
        return await join(coordinator, address, token, ps=True, index=given)

    async def join_worker() -> int:
        server.joined = True  # its index comes with the coordinator's configuration
        return await join(coordinator, address, token)

    return join_ps if role == "ps" else join_worker


async def follow(
    role: str,
    coordinator: str,
    token: str | None,
    joined: str,
    rejoin: Callable[[], Awaitable[int]],
    period: float = FOLLOW_PERIOD_S,
) -> None:
    """A ``role`` task: join again (``rejoin``) each time a coordinator other than
    incarnation ``joined`` serves at ``coordinator``; runs until cancelled."""
    unreachable = False
    while True:
        await asyncio.sleep(period)  # a poll: nothing to wait on but the coordinator
        try:
            now = await incarnation(coordinator, token)
        except PstrainError as exc:
            if not unreachable:
                logger.info("%s; asking again every %g s", exc, period)
            unreachable = True
            continue
        unreachable = False
        if now == joined:
            continue
        try:
            index = await rejoin()
        except PstrainError as exc:
            logger.warning(
                "another coordinator serves at %s, and joining it failed (%s); trying again in %g s",
                coordinator,
                exc,
                period,
            )
            continue
        joined = now
        print(
            f"pstrain {role} joined {coordinator} again (another coordinator) as {role} {index}", flush=True
        )
