"""The coordinator's endpoint: a server on the same core as every ps and worker.

It answers ``statistics`` (what ``pstrain status`` shows), ``coordinator/join`` (a worker
started with ``--join`` asks for a slot) and ``coordinator/membership`` (each worker slot),
over the stream (mutually authenticated, as every pstrain channel) and as
``POST /v1/<op>``; and ``GET /metrics`` and ``/healthz``, like every server. Its task
name is the chief's (``/job:chief/replica:0/task:0``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .._formats.operations import Join, Membership
from .._serving.base import ServerBase

__all__ = ["CoordinatorEndpoint"]


class CoordinatorEndpoint(ServerBase):
    """The coordinator's port. ``stats`` adds the coordinator's counters to ``statistics``
    (and so to ``/metrics``); ``join`` admits a worker and returns its index."""

    def __init__(self, stats: Callable[[], dict[str, Any]], join: Callable[[str], Awaitable[int]],
                 membership: Callable[[], list[dict[str, Any]]], *, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None) -> None:
        super().__init__("chief", 0, host=host, port=port, token=token)
        self._stats = stats
        self._admit = join
        self._membership = membership
        self.route(Join, self._join)
        self.route(Membership, self._members)

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out.update(self._stats())
        return out

    async def _join(self, req: Join) -> dict[str, Any]:
        return {"index": await self._admit(req.address)}

    def _members(self, _: Any) -> dict[str, Any]:
        return {"workers": self._membership()}
