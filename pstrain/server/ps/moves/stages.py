"""Who started each stage of a move on one ps, and the timer that ends a stage whose
next step does not come (:mod:`pstrain.server.ps.moves.handlers` decides what ending it means).

A stage is named by its side (``"out"`` on the ps giving variables away, ``"in"`` on the
one receiving them) and the move's stage name. Its steps must come from the coordinator
incarnation that started it (none comes from one a newer coordinator took over from: the
ps refuses those before any handler, ``handlers.ParameterServer.route``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ...._base.errors import FailedPreconditionError

__all__ = ["Stages"]

Stage = tuple[str, str]  # (side, stage name)


class Stages:
    """The stages of moves in progress on one ps: their owners and their timers.
    ``on_expire(side, stage)`` runs when a stage's time is up (it holds names only)."""

    def __init__(self, on_expire: Callable[[str, str], None]) -> None:
        self.on_expire = on_expire
        self.owners: dict[Stage, str | None] = {}
        self._timers: dict[Stage, asyncio.TimerHandle] = {}

    def start(self, side: str, stage: str, owner: str | None, ttl_s: float) -> None:
        """``stage`` started on ``side`` by ``owner``: it ends after ``ttl_s`` unless its
        next step comes (a timer set before for the same name goes: a stage whose name
        comes again is a new move)."""
        self.owners[side, stage] = owner
        self.stop_timer(side, stage)
        self._timers[side, stage] = asyncio.get_running_loop().call_later(ttl_s, self._expired, side, stage)

    def check(self, side: str, req: Any) -> None:
        """Refuse a step of a move another coordinator started."""
        started = self.owners.get((side, req.stage), req.owner)
        if started != req.owner:
            raise FailedPreconditionError(
                f"{type(req).op()}: move {req.stage!r} was started here by another coordinator"
            )

    def stop_timer(self, side: str, stage: str) -> None:
        """``stage`` waits without a time limit from now on (or has ended)."""
        if (timer := self._timers.pop((side, stage), None)) is not None:
            timer.cancel()

    def ended(self, side: str, stage: str) -> None:
        """``stage`` on ``side`` waits for no more steps."""
        self.owners.pop((side, stage), None)
        self.stop_timer(side, stage)

    def of(self, owners: set[str]) -> list[Stage]:
        """The stages ``owners`` started (and ends them here)."""
        theirs = [key for key, owner in self.owners.items() if owner in owners]
        for side, stage in theirs:
            self.ended(side, stage)
        return theirs

    def _expired(self, side: str, stage: str) -> None:
        self._timers.pop((side, stage), None)
        self.on_expire(side, stage)
