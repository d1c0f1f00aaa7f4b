"""The job as one process takes part in it, apart from the channels that carry its requests.

A :class:`JobSession` holds what a coordinator (or a worker, for its closures) knows of the
job: whose updates its requests carry (``owner``, the strategy's incarnation), the worker
dispatches its coordinator fenced (sent again to a ps before a restore, which a restarted ps
lost), the ps incarnations a checkpoint was restored onto (a restart already handled), where
each variable and table slice lives now (the placement map), and the lock that lets saves
share the placement and moves and restores hold it alone. A
:class:`~pstrain._transport.channels.ChannelPool` carries one session, and each channel it opens
reads it; a channel made alone has its own, empty one.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._base.locks import PlacementLock
from .._formats.messages.placement_map import PlacementMap

__all__ = ["JobSession"]


class JobSession:
    """One job's state in this process (see the module's docstring)."""

    __slots__ = ("owner", "restored", "fences", "routes", "placement_lock")

    def __init__(self, ps: Sequence[str] = ()) -> None:
        #: The coordinator incarnation (strategy owner id) whose updates these channels send
        #: (None on a worker: a closure's own comes with its dispatch).
        self.owner: str | None = None
        #: task -> incarnations of that ps a checkpoint was restored onto (the coordinator's
        #: PsHealth reads it: such a restart is handled).
        self.restored: dict[str, set[str]] = {}
        #: worker -> the epoch its coordinator fenced it before: a restore fences them again
        #: first, on a ps that restarted without them.
        self.fences: dict[int, int] = {}
        #: Where each variable lives now (the newest map known; ``ChannelPool.adopt`` replaces it).
        self.routes = PlacementMap(ps=list(ps))
        #: Moves and restores alone, saves shared.
        self.placement_lock = PlacementLock()
