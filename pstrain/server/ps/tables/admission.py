"""Admission of a dynamic table's ids: the sightings of ids not admitted yet, and the
policy (``admit_after`` sightings, or ``admit_probability`` at each) that decides when an
id gets a row. A mixin of :class:`~pstrain.server.ps.tables.dynamic_table.DynamicTable`.

Sightings live in an id index (id -> slot of ``_cand_counts``), slots handed out in order,
so the oldest are the lowest and are forgotten first (past ``max_candidates``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...._formats.numerics.idhash import unit_uniform
from ...._kernels.id_index import IdIndex

if TYPE_CHECKING:
    from .table_config import TableConfig


class Admission:
    """Which new ids a dynamic table admits, and the sightings of the others."""

    #: Times sightings were forgotten for the budget (:meth:`shed_sightings`).
    sightings_shed = 0

    if TYPE_CHECKING:
        config: TableConfig
        _cand: IdIndex
        _cand_ids: np.ndarray
        _cand_counts: np.ndarray
        _cand_used: int

    @property
    def candidates(self) -> int:
        """Ids seen but not admitted yet, remembered."""
        return len(self._cand)

    def _admit(self, ids: np.ndarray, where: np.ndarray) -> np.ndarray:
        """``where[i]`` of each of ``ids`` (unique, absent, int64) admitted now, in order;
        counts the others' sightings."""
        cfg = self.config
        if cfg.admit_after is None and cfg.admit_probability is None:
            return where
        if cfg.admit_after is None:
            return where[self._admit_by_chance(ids)]
        admitted = np.empty(ids.size, np.int64)
        done = taken = 0
        while True:  # one compiled pass, unless the sightings fill up: forget, go on
            todo = ids.size - done
            room = min(todo, max(0, cfg.max_candidates - len(self._cand)))
            self._sightings_room(room)
            self._room_for(room)
            n, added, admits = self._cand.count_sightings(
                ids[done:],
                where[done:],
                self._cand_counts,
                self._cand_ids,
                admitted[taken:],
                cfg.admit_after,
                self._cand_used,
                room,
            )
            self._cand_used += added
            done += n
            taken += admits
            if done == ids.size:
                return admitted[:taken]
            self._forget(ids.size - done)

    def _admit_by_chance(self, ids: np.ndarray) -> np.ndarray:
        cfg = self.config
        assert cfg.admit_probability is not None
        slots = self._cand.get(ids)
        seen = slots >= 0
        counts = np.ones(ids.size, np.int64)
        counts[seen] += self._cand_counts[slots[seen]]
        admit = unit_uniform(ids ^ counts, cfg.seed + 0x51ED) < cfg.admit_probability
        self._cand.delete(ids[admit & seen])  # admitted: no longer a candidate
        self._cand_counts[slots[admit & seen]] = 0
        again = ~admit & seen
        self._cand_counts[slots[again]] = counts[again]
        new = ~admit & ~seen
        if new.any():
            self._remember(ids[new])
        return admit

    def _forget(self, coming: int) -> None:
        """Forget the oldest half of the sightings (at least enough for one more id, at
        most what leaves room for ``coming``): slots are handed out in order and an
        admitted id's count is 0, so the newest are the last nonzero counts (no sort)."""
        limit = self.config.max_candidates
        live = self._live_slots()
        self._compact(live[live.size - max(0, min(live.size - live.size // 2, limit - coming, limit - 1)) :])

    def _sightings_room(self, n: int) -> None:
        """Called before up to ``n`` more ids are counted: a tiered table forgets sightings
        here while their growth would take its ps past the budget."""

    def sightings_bytes(self) -> int:
        """What the sightings hold in RAM (their index and slots)."""
        return self._cand.nbytes + self._cand_counts.nbytes + self._cand_ids.nbytes

    def shed_sightings(self) -> bool:
        """Forget the oldest half of the sightings (at least one) and give back the memory
        they held, the index and the slots made again for the rest: what a tiered table
        does when the budget needs that memory for rows. Whether there were any."""
        live = self._live_slots()
        if not live.size and not self._cand_counts.size:
            return False
        keep = live[(live.size + 1) // 2 :]
        ids, counts = self._cand_ids[keep], self._cand_counts[keep]
        self._cand = IdIndex(kernels=self._cand.kernels)
        self._cand.insert(ids, np.arange(ids.size, dtype=np.int64))
        self._cand_ids, self._cand_counts, self._cand_used = ids, counts, int(ids.size)
        self.sightings_shed += 1
        return True

    def _live_slots(self) -> np.ndarray:
        """The slots of the ids still counted, oldest first (an admitted id's count is 0)."""
        return np.flatnonzero(self._cand_counts[: self._cand_used] > 0)

    def _compact(self, keep: np.ndarray) -> None:
        """Keep only the sightings in slots ``keep`` (ascending), moved to the lowest slots
        in the same order (the oldest stay lowest)."""
        n, used = keep.size, self._cand_used
        self._cand_ids[:n] = self._cand_ids[keep]
        self._cand_counts[:n] = self._cand_counts[keep]
        self._cand_counts[n:used] = 0
        self._cand_used = n
        self._cand.clear()
        self._cand.insert(self._cand_ids[:n], np.arange(n))

    def _room_for(self, n: int) -> None:
        """Sighting slots for ``n`` more ids. An id's slot is not reused once it is
        admitted, so when the slots run out and at most half of them would still be
        counted, the counted ones are moved down instead of the slots growing: the slots
        stay within twice the ids counted at once, however many are admitted over time."""
        if self._cand_used + n <= self._cand_counts.size:
            return
        size = self._slots_for(n)
        if size == self._cand_counts.size:
            self._compact(self._live_slots())
            return
        self._cand_counts = np.concatenate(
            [self._cand_counts, np.zeros(size - self._cand_counts.size, np.int64)]
        )
        self._cand_ids = np.concatenate([self._cand_ids, np.zeros(size - self._cand_ids.size, np.int64)])

    def _slots_for(self, n: int) -> int:
        """How many sighting slots :meth:`_room_for` leaves for ``n`` more ids: as many as
        now while they fit, or once the ids still counted (the index's) move down into at
        most half of them; else grown (doubled, at least to what is needed)."""
        need, size = self._cand_used + n, self._cand_counts.size
        if need <= size or len(self._cand) + n <= size // 2:
            return size
        return max(need, 2 * size, 1024)

    def _remember(self, ids: np.ndarray) -> None:
        """Start counting ``ids`` (one sighting each); past ``max_candidates`` the oldest
        half is forgotten."""
        limit = self.config.max_candidates
        if len(self._cand) + ids.size > limit:
            self._forget(ids.size)
            ids = ids[max(0, ids.size - limit) :]
        self._sightings_room(ids.size)
        self._room_for(ids.size)
        need = self._cand_used + ids.size
        slots = np.arange(self._cand_used, need)
        self._cand_counts[slots] = 1
        self._cand_ids[slots] = ids
        self._cand.insert(ids, slots)
        self._cand_used = need
