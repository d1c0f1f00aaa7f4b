"""Where each row on disk lies, held in 32 bits (:class:`Places`): the per-slot array of a
tier's rows on disk (:class:`~pstrain.server.ps.tables.cold_rows.ColdRows`), which with
their index is all the RAM such a row costs; and the places a save reads, marked when it
begins (:class:`SavedPlaces`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from ...._base.errors import ResourceExhaustedError
from ...._formats.files.table_links import pack
from ...._formats.numerics.idhash import in_slices
from ...._kernels import KERNELS

__all__ = ["FREE", "PLACE_BITS", "MaskedPlaces", "Places", "SavedPlaces", "place_blocks"]

#: A place: segment number << PLACE_BITS | record number.
PLACE_BITS = 32
#: The place of a cold slot not in use.
FREE = -1


class Places:
    """Each cold slot's place, held in 32 bits rather than 64: a *handle* (a run of
    ``2**bits`` records of one segment, ``bits`` enough for a segment of records whole) and
    the record's number within it. A segment takes its handles when it is made (a linked
    file as many as its records need) and gives them back when it goes, so handles are
    reused while places are not: indexed (``places[slots]``) they read back as the int64
    places everything else uses, ``number << PLACE_BITS | record``, and ``FREE`` (-1) for
    a slot not in use; assigned, they are encoded (their segments must hold handles).
    With 32 bits of handle and record, 2**32 records of live segments can be addressed,
    about as many as ``MAX_SLOTS`` rows; past that, a new segment is refused
    (ResourceExhaustedError) before anything is written."""

    #: A slot not in use (its handle is never given).
    FREE = np.uint32(0xFFFFFFFF)

    def __init__(self, segment_rows: int) -> None:
        self.bits = max(1, (segment_rows - 1).bit_length())
        self.mask = (1 << self.bits) - 1
        self.limit = (1 << (32 - self.bits)) - 1  # handles there may be (the last is FREE's)
        self.codes = np.empty(0, np.uint32)
        #: Per handle given: its segment's number, and the first record it covers.
        self.numbers = np.empty(0, np.int64)
        self.firsts = np.empty(0, np.int64)
        self.spare: list[int] = []  # handles given back, to give again
        self.of: dict[int, np.ndarray] = {}  # segment number -> its handles

    @property
    def size(self) -> int:
        return int(self.codes.size)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.handle_bytes())

    def handle_bytes(self, segments: int = 0) -> int:
        """What the handles take, with ``segments`` more segments of records."""
        return 16 * (self.numbers.size + max(0, segments - len(self.spare)))

    def take(self, number: int, records: int) -> None:
        """Handles for segment ``number`` of up to ``records`` records; ResourceExhaustedError
        (nothing taken) if there are not as many."""
        need = max(1, -(-records // (1 << self.bits)))
        fresh = need - min(need, len(self.spare))
        if self.numbers.size + fresh > self.limit:
            raise ResourceExhaustedError(
                f"a tier addresses at most {self.limit << self.bits} records on disk in one "
                "shard (its segments' records, live or dead): shard the table over more ps"
            )
        given = [self.spare.pop() for _ in range(need - fresh)]
        if fresh:
            top = self.numbers.size
            self.numbers = np.concatenate([self.numbers, np.empty(fresh, np.int64)])
            self.firsts = np.concatenate([self.firsts, np.empty(fresh, np.int64)])
            given += range(top, top + fresh)
        handles = np.array(given, np.int64)
        self.numbers[handles] = number
        self.firsts[handles] = np.arange(need, dtype=np.int64) << self.bits
        self.of[number] = handles

    def give_back(self, number: int) -> None:
        """Segment ``number`` went: its handles may be given again (no slot holds them)."""
        handles = self.of.pop(number, None)
        if handles is not None:
            self.spare.extend(handles.tolist())

    def live(self, lo: int, hi: int) -> np.ndarray:
        """Which slots ``lo:hi`` are in use."""
        return self.codes[lo:hi] != self.FREE

    def free_in(self, lo: int, hi: int) -> np.ndarray:
        """The slots of ``lo:hi`` not in use, ascending (a scan's: one pass, no mask to
        invert)."""
        return np.flatnonzero(self.codes[lo:hi] == self.FREE) + lo

    def __getitem__(self, at: Any) -> np.ndarray:
        codes = np.ascontiguousarray(self.codes[at])
        # decoded in one compiled pass: no temporaries besides the result
        out = KERNELS.decode_places(codes.reshape(-1), self.bits, self.numbers, self.firsts)
        return out.reshape(codes.shape)

    def in_segment(self, slots: np.ndarray, number: int) -> np.ndarray:
        """Which of ``slots`` (in use) hold places in segment ``number``."""
        return np.isin(self.codes[slots] >> self.bits, self.of.get(number, np.empty(0, np.int64)))

    def __setitem__(self, at: Any, places: Any) -> None:
        self.codes[at] = self.encode(np.asarray(places, np.int64))

    def encode(self, places: np.ndarray) -> np.ndarray:
        """``places`` (int64, or FREE) in 32 bits."""
        if not places.size:
            return np.empty(places.shape, np.uint32)
        out = np.full(places.shape, self.FREE, np.uint32)
        used = places >= 0
        whole = bool(used.all())
        at = places if whole else places[used]
        if not at.size:
            return out
        numbers, records = at >> PLACE_BITS, at & ((1 << PLACE_BITS) - 1)
        low, high = int(numbers.min()), int(numbers.max())
        if low == high:  # (the usual case: one segment's records)
            handles = self.of[low][records >> self.bits]
        else:
            handles = np.empty(at.size, np.int64)
            for number in np.unique(numbers).tolist():
                there = numbers == number
                handles[there] = self.of[number][records[there] >> self.bits]
        codes = ((handles << self.bits) | (records & self.mask)).astype(np.uint32)
        if whole:
            return codes
        out[used] = codes
        return out


class Tier(Protocol):
    """What :class:`SavedPlaces` reads of a tier
    (:class:`~pstrain.server.ps.tables.cold_rows.ColdRows`)."""

    @property
    def segments(self) -> dict[int, Any]: ...  # number -> segment (its ``rows``: records written)

    used: int
    places: Places
    epochs: np.ndarray

    def ids_by_slot(self) -> np.ndarray: ...


class SavedPlaces:
    """The places of the rows on disk a save reads, as they were when it began, in place
    order (by segment, then record), a block at a time (:meth:`between`).

    Held as a byte per record of the segments there then, live or not (set: the save
    reads it), not as the places themselves: 8 bytes per row on disk, a sixth of what
    their index takes, would come on top of the budget for the whole save. Segments are
    compacted once half dead, so this is at most about 2 bytes a row. Made on the serving
    loop, a slice of the cold slots at a time (no array of every live slot besides).
    """

    #: Records whose marks are counted together (the unit :meth:`between` starts from).
    PIECE = 1 << 14

    def __init__(
        self, cold: Tier, since: int | None = None, moving: tuple[int, list[int]] | None = None
    ) -> None:
        self.numbers = np.array(sorted(cold.segments), np.int64)
        lengths = np.array([cold.segments[int(n)].rows for n in self.numbers], np.int64)
        #: Where each segment's first record is among the marks.
        self.base = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
        self.marks = np.zeros(int(self.base[-1]), bool)
        low = (1 << PLACE_BITS) - 1
        if moving is not None:  # (an id per cold slot, while this runs)
            by_slot = cold.ids_by_slot()
        for lo in range(0, cold.used, self.PIECE):
            hi = min(cold.used, lo + self.PIECE)
            live = cold.places.live(lo, hi)
            if since is not None:
                live = live & (cold.epochs[lo:hi] > since)
            if moving is not None:
                live = live & in_slices(by_slot[lo:hi], *moving)
            places = cold.places[np.flatnonzero(live) + lo]
            seg = np.searchsorted(self.numbers, places >> PLACE_BITS)
            self.marks[self.base[seg] + (places & low)] = True
        counts = [
            np.count_nonzero(self.marks[a : a + self.PIECE]) for a in range(0, self.marks.size, self.PIECE)
        ]
        #: Marked records before each piece (and all of them, last).
        self.before = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts, dtype=np.int64)])
        self.size = int(self.before[-1])

    def take_out(self, number: int) -> np.ndarray:
        """Segment ``number``'s marks (whether the save reads each record), as a link's bits
        (``table_links.pack``), which the save no longer reads (a full save that links the
        segment's file instead)."""
        k = int(np.searchsorted(self.numbers, number))
        if k == self.numbers.size or self.numbers[k] != number:
            raise KeyError(number)
        lo, hi = int(self.base[k]), int(self.base[k + 1])
        out = pack(self.marks[lo:hi])
        self.marks[lo:hi] = False
        first, last = lo // self.PIECE, (hi + self.PIECE - 1) // self.PIECE
        counts = np.diff(self.before)
        for p in range(first, last):
            counts[p] = np.count_nonzero(self.marks[p * self.PIECE : (p + 1) * self.PIECE])
        self.before = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts, dtype=np.int64)])
        self.size = int(self.before[-1])
        return out

    def between(self, lo: int, hi: int) -> np.ndarray:
        """The places of the ``lo``-th to ``hi``-th rows (ascending)."""
        hi = min(hi, self.size)
        if lo >= hi:
            return np.empty(0, np.int64)
        k = int(np.searchsorted(self.before, lo, "right")) - 1
        parts, skip, want = [], lo - int(self.before[k]), hi - lo
        while want > 0:
            flat = np.flatnonzero(self.marks[k * self.PIECE : (k + 1) * self.PIECE])[skip : skip + want]
            parts.append(flat + k * self.PIECE)
            want -= flat.size
            skip, k = 0, k + 1
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
        seg = np.searchsorted(self.base, flat, "right") - 1
        return (self.numbers[seg] << PLACE_BITS) | (flat - self.base[seg])


class MaskedPlaces:
    """The places of the records of segment ``number`` where ``mask`` is set from record
    ``start`` on, in order, made a block at a time (:meth:`blocks`): the rows a restore
    leaves in a file it linked into the tier, which an array of their places would hold at
    8 bytes a row until they are indexed."""

    def __init__(self, number: int, mask: np.ndarray, start: int = 0) -> None:
        self.number, self.mask, self.start = number, mask, start

    def blocks(self, records: int) -> Iterator[np.ndarray]:
        """The places, about ``records`` of the mask's records scanned at a time."""
        for lo in range(self.start, self.mask.size, records):
            found = np.flatnonzero(self.mask[lo : lo + records])
            if found.size:
                yield (found + lo) | (np.int64(self.number) << PLACE_BITS)


def place_blocks(places: np.ndarray | MaskedPlaces, size: int) -> Iterator[np.ndarray]:
    """``places`` (an array, or :class:`MaskedPlaces`) a block of at most ``size`` at a time."""
    if isinstance(places, MaskedPlaces):
        yield from places.blocks(size)
    else:
        for lo in range(0, places.size, size):
            yield places[lo : lo + size]
