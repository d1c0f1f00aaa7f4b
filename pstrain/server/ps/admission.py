"""Admission of a dynamic table's ids: the sightings of ids not admitted yet, and the
policy (``admit_after`` sightings, or ``admit_probability`` at each) that decides when an
id gets a row. A mixin of :class:`~pstrain.server.ps.dynamic_table.DynamicTable`.

Sightings live in an id index (id -> slot of ``_cand_counts``), slots handed out in order,
so the oldest are the lowest and are forgotten first (past ``max_candidates``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..._formats.idhash import unit_uniform

if TYPE_CHECKING:
    from .id_index import IdIndex
    from .table_config import TableConfig


class Admission:
    """Which new ids a dynamic table admits, and the sightings of the others."""

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

    def _admit(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` (unique, absent) are admitted now; counts the others' sightings."""
        cfg = self.config
        if cfg.admit_after is None and cfg.admit_probability is None:
            return np.ones(ids.size, bool)
        slots = self._cand.get(ids)
        seen = slots >= 0
        counts = np.ones(ids.size, np.int64)
        counts[seen] += self._cand_counts[slots[seen]]
        if cfg.admit_after is not None:
            admit = counts >= cfg.admit_after
        else:
            assert cfg.admit_probability is not None
            admit = unit_uniform(ids ^ counts, cfg.seed + 0x51ED) < cfg.admit_probability
        self._cand.delete(ids[admit & seen])  # admitted: no longer a candidate
        self._cand_counts[slots[admit & seen]] = 0
        again = ~admit & seen
        self._cand_counts[slots[again]] = counts[again]
        new = ~admit & ~seen
        if new.any():
            self._remember(ids[new])
        return admit

    def _remember(self, ids: np.ndarray) -> None:
        """Start counting ``ids`` (one sighting each); past ``max_candidates`` the oldest
        half is forgotten."""
        limit = self.config.max_candidates
        if len(self._cand) + ids.size > limit:
            # Slots are handed out in order and an admitted id's count is 0: the newest
            # live sightings are the last nonzero counts, found without a sort.
            used = self._cand_used
            live = np.flatnonzero(self._cand_counts[:used] > 0)
            half = live.size - live.size // 2 if live.size > 1 else 0
            keep = live[live.size - max(0, min(half, limit - ids.size)):]
            n = keep.size
            self._cand_ids[:n] = self._cand_ids[keep]
            self._cand_counts[:n] = self._cand_counts[keep]
            self._cand_counts[n:used] = 0
            self._cand_used = n
            self._cand.clear()
            self._cand.insert(self._cand_ids[:n], np.arange(n))
            ids = ids[max(0, ids.size - limit):]
        need = self._cand_used + ids.size
        if need > self._cand_counts.size:
            size = max(need, 2 * self._cand_counts.size, 1024)
            self._cand_counts = np.concatenate(
                [self._cand_counts, np.zeros(size - self._cand_counts.size, np.int64)]
            )
            self._cand_ids = np.concatenate([self._cand_ids, np.zeros(size - self._cand_ids.size, np.int64)])
        slots = np.arange(self._cand_used, need)
        self._cand_counts[slots] = 1
        self._cand_ids[slots] = ids
        self._cand.insert(ids, slots)
        self._cand_used = need
