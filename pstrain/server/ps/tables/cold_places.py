"""Where each row on disk lies, held in 32 bits (:class:`Places`): the per-slot array of a
tier's rows on disk (:class:`~pstrain.server.ps.tables.cold_rows.ColdRows`), which with
their index is all the RAM such a row costs."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...._base.errors import ResourceExhaustedError

__all__ = ["FREE", "PLACE_BITS", "Places"]

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
    #: Places decoded at a time (what a decoding holds besides its result).
    BLOCK = 1 << 16

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
        codes = self.codes[at]
        out = np.full(codes.shape, FREE, np.int64)
        if not self.numbers.size:  # (no segment yet: every slot is free)
            return out
        flat_codes, flat = codes.reshape(-1), out.reshape(-1)
        for lo in range(0, flat_codes.size, self.BLOCK):  # (temporaries of a block at most)
            part = flat_codes[lo : lo + self.BLOCK]
            used = np.flatnonzero(part != self.FREE)
            part = part[used]
            handles = part >> self.bits
            records = self.firsts[handles] + (part & self.mask)
            flat[lo + used] = (self.numbers[handles] << PLACE_BITS) | records
        return out

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
