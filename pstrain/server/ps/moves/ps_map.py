"""The placement map a ps knows: the newest its coordinator told it (``ps/placement``, and
with a move's steps), which it hands to a client it refuses (a variable moved away) and
to whoever asks (``ps/placement/read``).

Maps are ordered by version within one coordinator incarnation. A restarted coordinator
numbers its maps from the start again, so a map of the one it took over from, however
high its version, goes with the takeover: the ps then knows no map until the new
coordinator sends one, and forgets what the old one said moved away from it. A map from
another coordinator replaces the one the ps knows whatever their versions, as when the
new one took nothing over here (its variables are named apart): a coordinator a newer
one took over from is refused before its map gets here.
"""

from __future__ import annotations

from ...._formats.messages.placement_map import (
    PlacementMap,
    PlacementReply,
    ReadPlacement,
    SetPlacement,
    VersionReply,
)
from ...._serving.core import Router
from ..store import VariableStore

__all__ = ["PsMap"]


class PsMap:
    """The placement map of one ps (kept as ``store.placement``, which refusals carry)."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        #: The coordinator incarnation that sent the map this ps knows.
        self.owner: str | None = None

    def install(self, route: Router) -> None:
        """Route the placement map's operations to their handlers here."""
        route(SetPlacement, self.set_placement)
        route(ReadPlacement, self.read_placement)

    def set_placement(self, req: SetPlacement) -> VersionReply:
        self.adopt(req.placement, req.owner)
        return VersionReply(version=self.store.placement.version)

    def read_placement(self, _: ReadPlacement) -> PlacementReply:
        return PlacementReply(placement=self.store.placement)

    def adopt(self, placement: PlacementMap, owner: str | None) -> None:
        """Know ``placement`` (sent for coordinator ``owner``) if it is newer: a higher
        version, or a map of another coordinator."""
        if placement.version <= self.store.placement.version and (
            owner is None or owner == self.owner or self.owner is None
        ):
            return
        self.store.placement = placement
        self.owner = owner
        task = self.store.task
        mine = int(task.rsplit(":", 1)[1]) if task.startswith("/job:ps/") else len(placement.ps)
        if mine < len(placement.ps) and not placement.ps[mine]:
            self._retire()

    def superseded(self, owners: set[str], arriving: set[str]) -> None:
        """A newer coordinator took this ps over from ``owners``: if one of them sent the
        map, the map goes, and what it said moved away from here (but not the names of
        copies still ``arriving``, staged for a move of another coordinator)."""
        if self.owner in owners:
            self.store.placement = PlacementMap()
            self.owner = None
            for name in [n for n in self.store.away if n not in arriving]:
                del self.store.away[name]

    def _retire(self) -> None:
        """The map says this ps left the job: it was lost, and its variables were put on the
        others from a checkpoint (a partition that healed). It serves none of them from now
        on: a client still routing here by an older map is refused with the new one."""
        for name in self.store.take_all():
            self.store.away[name] = "was replaced on the other ps: it no longer lives on"
