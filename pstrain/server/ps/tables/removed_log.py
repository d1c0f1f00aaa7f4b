"""The ids a dynamic table's shard evicted, kept for its next delta checkpoint."""

from __future__ import annotations

import numpy as np

from ..store import ChangeClock

__all__ = ["MAX_REMOVED", "RemovedLog"]

#: Evicted ids kept for the next delta checkpoint: at most this many, or twice the capacity
#: (past it the log is dropped, and the next checkpoint is a full one).
MAX_REMOVED = 1 << 20


class RemovedLog:
    """Evicted ids with the epoch of their eviction; every eviction after ``since`` is known.

    >>> log = RemovedLog(ChangeClock(), capacity=None)
    >>> log.add(np.array([5, 7]))
    >>> log.after(0).tolist(), log.since
    ([5, 7], 0)
    """

    def __init__(self, clock: ChangeClock, capacity: int | None) -> None:
        self.clock = clock
        self.limit = max(MAX_REMOVED, 2 * (capacity or 0))
        self._log: list[tuple[int, np.ndarray]] = []
        self._count = 0
        self.since = clock.epoch - 1

    def add(self, ids: np.ndarray) -> None:
        if self._count + ids.size > self.limit:  # dropped: a delta since before now is refused
            self._log.clear()
            self._count = 0
            self.since = self.clock.epoch
            return
        self._log.append((self.clock.epoch, ids))
        self._count += ids.size

    def after(self, mark: int) -> np.ndarray:
        """The ids evicted after ``mark`` (unique, ascending); forgets those up to it."""
        self._log = [(e, a) for e, a in self._log if e > mark]
        self._count = sum(a.size for _, a in self._log)
        return np.unique(np.concatenate([a for _, a in self._log])) if self._log else np.empty(0, np.int64)

    def kept(self) -> np.ndarray:
        """Every id evicted since ``since`` (unique), without forgetting any."""
        return np.unique(np.concatenate([a for _, a in self._log])) if self._log else np.empty(0, np.int64)
