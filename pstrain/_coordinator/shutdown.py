"""The end of a job: ask every ps and worker to leave (``ClusterCoordinator.shutdown_cluster``)."""

from __future__ import annotations

import asyncio
import logging

from .._base.cluster import task_name
from .._base.errors import PstrainError, UnavailableError
from .._formats.messages.operations import Shutdown
from .._transport.channels import ChannelPool

logger = logging.getLogger(__name__)

__all__ = ["ask_to_leave"]


async def ask_to_leave(channels: ChannelPool, startup_wait_s: float) -> list[str]:
    """Ask every task of the cluster to leave; returns those that did not (refused, or
    unreachable). A task never reached yet may still be starting: it is asked again, with
    back-off, for up to ``startup_wait_s``."""
    spec = channels.cluster_spec
    tasks = [(job, i) for job in ("ps", "worker") for i in range(spec.num_tasks(job))]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + startup_wait_s

    async def leave(job: str, index: int) -> str | None:
        channel = channels.channel(job, index)
        pause = 0.05
        while True:
            try:
                await channel.request(Shutdown(), timeout=10.0)
                return None
            except UnavailableError as exc:
                if channel.ever_connected or loop.time() + pause > deadline:
                    return f"{task_name(job, index)}: {exc}"
            except PstrainError as exc:
                return f"{task_name(job, index)}: {exc}"
            await asyncio.sleep(pause)  # back-off while a task that never answered starts
            pause = min(pause * 2, 1.0)

    stayed = [r for r in await asyncio.gather(*(leave(j, i) for j, i in tasks)) if r is not None]
    for line in stayed:
        logger.warning("did not leave: %s", line)
    return stayed
