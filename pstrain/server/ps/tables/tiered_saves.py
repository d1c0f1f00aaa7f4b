"""What a save of a tiered table reads: each array's rows in RAM through its snapshot, then
the rows on disk as they were when the save began, read once for every array
(:class:`ColdPart`, :class:`TieredSource`). A full save takes out of the rows on disk
those of the checkpoint files a restore linked in, which it links instead
(:meth:`~pstrain.server.ps.tables.tiered_table.TieredTable.save_links`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..checkpoints.snapshots import Snapshot
from .cold_places import SavedPlaces
from .cold_rows import ColdRows

__all__ = ["SAVE_BLOCK", "ColdPart", "TieredSource"]

#: Rows a save reads from disk at a time (at most: fewer if they would take more than its
#: staging, ``tiered_table.save_bytes``).
SAVE_BLOCK = 1 << 14


class ColdPart:
    """The rows on disk a save writes: their places as they were when it began (taken on
    the serving loop), and every array's part of them at once (:meth:`tails`: each record
    read once for all)."""

    def __init__(
        self,
        cold: ColdRows,
        places: SavedPlaces,
        slot_init: dict[str, float],
        block: int = SAVE_BLOCK,
        whole: bool = False,
    ) -> None:
        self.cold, self.places, self.slot_init = cold, places, slot_init
        self.block = block  # records read at a time
        #: Whether the save reads every row of the tier (a full save; not a delta's rows
        #: changed since, nor a move's slices): the one whose linked files it may link.
        self.whole = whole

    @property
    def size(self) -> int:
        return self.places.size

    def tails(self, keys: list[str]) -> Iterator[dict[str, np.ndarray]]:
        """Arrays ``keys``' rows on disk, a block of each at a time, in order."""
        for lo in range(0, self.size, self.block):
            yield self.cold.fill_many(self.places.between(lo, lo + self.block), keys, self.slot_init)


class TieredSource:
    """A save's source for one array of a tiered table: its hot part (a :class:`Snapshot`)
    then its rows on disk (``part``, shared by the save's arrays: ``tail_source``, which a
    file written in one go reads once for all of them)."""

    def __init__(self, hot: Snapshot, part: ColdPart, key: str) -> None:
        self.hot, self.part, self.key = hot, part, key
        self.cold, self.slot_init = part.cold, part.slot_init
        self.array = hot.array
        self.select = hot.select

    @property
    def tail_source(self) -> ColdPart:
        return self.part

    @property
    def tail_key(self) -> str:
        return self.key

    def head_blocks(self) -> Iterator[np.ndarray]:
        return self.hot.blocks()

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.hot.shape[0] + self.part.size, *self.hot.shape[1:])

    def before_write(self, rows: np.ndarray | None) -> None:
        self.hot.before_write(rows)

    def blocks(self) -> Iterator[np.ndarray]:
        yield from self.hot.blocks()
        for lo in range(0, self.part.size, self.part.block):
            yield self._cold_block(lo, min(self.part.size, lo + self.part.block), None)

    def write_to(self, writer: Any) -> int:
        """The hot part, then the rows on disk, each block read straight into the writer's
        staging buffer where it fits (as :meth:`Snapshot.write_to` does)."""
        got = self.hot.write_to(writer)
        arr = self.array
        row_bytes = arr.itemsize * int(np.prod(arr.shape[1:]))
        lo, count = 0, self.part.size
        while lo < count:
            room = writer.room()
            fits = room.size // row_bytes if room.ctypes.data % arr.itemsize == 0 else 0
            hi = min(count, lo + self.part.block, lo + max(1, fits))
            if fits:
                dest = room[: (hi - lo) * row_bytes].view(arr.dtype).reshape(hi - lo, *arr.shape[1:])
                self._cold_block(lo, hi, dest)
                writer.wrote(dest.nbytes)
            else:  # a row across the buffer's end, or a start not aligned: a copy of its own
                writer.write(self._cold_block(lo, hi, None).reshape(-1).view(np.uint8).data)
            got += (hi - lo) * row_bytes
            lo = hi
        return got

    def _cold_block(self, lo: int, hi: int, out: np.ndarray | None) -> np.ndarray:
        """Rows ``lo:hi`` of the part on disk (into ``out``, or a fresh array)."""
        if out is None:
            out = np.empty((hi - lo, *self.array.shape[1:]), self.array.dtype)
        if self.key == "live":
            out[:] = True
        else:
            self.cold.fill(self.part.places.between(lo, hi), self.key, self.slot_init, out)
        return out
