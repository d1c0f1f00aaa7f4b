"""The coordinator's endpoint: a server on the same core as every ps and worker.

It answers ``statistics`` (what ``pstrain status`` shows), ``coordinator/join`` (a worker
started with ``--join`` asks for a slot) and ``coordinator/membership`` (each worker slot),
over the stream (mutually authenticated, as every pstrain channel) and as
``POST /v1/<op>``; and ``GET /metrics`` and ``/healthz``, like every server. Its task
name is the chief's (``/job:chief/replica:0/task:0``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._base.cluster import ClusterSpec, is_loopback, parse_address
from .._base.errors import PstrainError
from .._formats.messages.operations import Join, JoinPs, LeavePs, Membership
from .._formats.messages.records import JoinReply, MembershipReply
from .._serving.base import ServerBase

logger = logging.getLogger("pstrain._coordinator.coordinator")

__all__ = ["CoordinatorEndpoint", "chief_address", "say_if_not_served"]


def chief_address(resolver: Any, spec: ClusterSpec) -> tuple[str, int] | None:
    """Where the coordinator serves its endpoint when the cluster names a chief with a port
    (``TF_CONFIG``) and this process is it; None otherwise."""
    if getattr(resolver, "task_type", None) != "chief" or not spec.num_tasks("chief"):
        return None
    host, port = parse_address(spec.task_address("chief", 0))
    if port == 0:
        return None
    return ("127.0.0.1" if is_loopback(host) else "0.0.0.0"), port


class CoordinatorEndpoint(ServerBase):
    """The coordinator's port. ``stats`` adds the coordinator's counters to ``statistics``
    (and so to ``/metrics``); ``join`` admits a worker and returns its index."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        join: Callable[[str], Awaitable[int]],
        membership: Callable[[], list[dict[str, Any]]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
    ) -> None:
        super().__init__("chief", 0, host=host, port=port, token=token)
        self._stats = stats
        self._admit = join
        self._membership = membership
        self.route(Join, self._join)
        self.route(Membership, self._members)
        #: ``(join, leave)`` of elastic ps: ``join(address, index) -> index``, ``leave(index)``.
        self.ps_changes: (
            tuple[Callable[[str, int | None], Awaitable[int]], Callable[[int], Awaitable[None]]] | None
        ) = None
        self.route(JoinPs, self._join_ps)
        self.route(LeavePs, self._leave_ps)

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out.update(self._stats())
        return out

    async def _join(self, req: Join) -> JoinReply:
        return JoinReply(index=await self._admit(req.address))

    async def _join_ps(self, req: JoinPs) -> JoinReply:
        assert self.ps_changes is not None
        return JoinReply(index=await self.ps_changes[0](req.address, req.index))

    async def _leave_ps(self, req: LeavePs) -> JoinReply:
        assert self.ps_changes is not None
        await self.ps_changes[1](req.index)
        return JoinReply(index=req.index)

    def _members(self, _: Membership) -> MembershipReply:
        return MembershipReply(workers=self._membership(), ps=self._stats().get("placement"))


async def say_if_not_served(serving: Awaitable[Any], host: str, port: int) -> None:
    """Serve the coordinator's endpoint at TF_CONFIG's address; a port in use is the user's
    to fix: say so, once, and train on without it."""
    try:
        await serving
    except (PstrainError, OSError) as exc:
        logger.error(
            "the coordinator could not serve /metrics on %s:%d: %s (training goes on without it)",
            host,
            port,
            exc,
        )
