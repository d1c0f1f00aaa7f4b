"""The files of a tiered shard's rows on disk: its *segments*, and their deletion.

A segment is a file in the tier's directory, numbered on and never again: either records
appended a block at a time, at most ``segment_rows`` of them (``<n>.rec``; a record is a
row whole: ``cold_records.py``), or a checkpoint file a restore hard-linked in
(``<n>.ref``), whose records are the rows of its tensors, read a column at a time. Neither
is ever written once named. :class:`SegmentFiles` writes, links, reads and deletes them and
counts each one's dead records; which row lies at which record is the business of
:class:`~pstrain.server.ps.tables.cold_rows.ColdRows`, which holds one, and when a segment
may go (no save or read using it) too.

Reads gather a segment's records by runs of neighbours through io_uring (``pread`` calls
where the kernel has none), without the GIL. Deletions (a dead segment, a tier that went)
run on a thread of their own (:func:`remove_soon`): unlinking hundreds of MB blocks for as
long as it takes, and the serving loop does not wait for that.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ...._base.errors import DataLossError, ResourceExhaustedError
from .cold_places import PLACE_BITS, Places
from .cold_records import META, record_dtype

__all__ = ["WRITE_ROWS", "Segment", "SegmentFiles", "remove_soon", "removals_done"]

#: Records written at a time (a block of them packed in RAM, then written).
WRITE_ROWS = 1 << 14


@dataclass
class Segment:
    number: int
    rows: int = 0  # records written
    dead: int = 0  # records taken back or evicted
    slots: tuple[str, ...] = ()  # the optimizer slots its records carry (others: their initial value)
    #: A checkpoint file linked in (:meth:`SegmentFiles.link`): where each field of a record
    #: it holds ("id", "row", "slot<i>") has its column, record 0's byte in the file; None
    #: for a segment of records.
    columns: dict[str, int] | None = None
    #: A linked file's size and last change when it was linked: a read that finds them
    #: changed (the file written in place since, which pstrain never does) fails.
    stamp: tuple[int, int] = (0, 0)
    #: A linked file's slots, by their names in it: the table's slot each is (None: one
    #: the table dropped). A full save links the file again only where each is saved
    #: under its name in the file (:meth:`SegmentFiles.linkable`).
    file_slots: dict[str, str | None] | None = None


#: Deletes the directories of tiers that went (:func:`remove_soon`) and the segments that
#: died (:meth:`SegmentFiles.collect`), one at a time.
_REMOVER = concurrent.futures.ThreadPoolExecutor(1, "pstrain-tier-remove")


def remove_soon(directory: str) -> None:
    """Directory ``directory`` out of the way at once (renamed beside itself, hidden), then
    deleted on a thread. A tier of gigabytes took 2 s to delete (W9's, a file a segment):
    the serving loop, where a table goes (a restore's commit replacing it, say), does not
    wait for that. A ps killed meanwhile leaves it in its own directory, which the next
    ps on that ``--table-dir`` removes (``tier_directory``)."""
    gone = os.path.join(
        os.path.dirname(directory), f".gone-{os.path.basename(directory)}-{secrets.token_hex(4)}"
    )
    try:
        os.rename(directory, gone)
    except FileNotFoundError:
        return
    except OSError:  # (not renamed: deleted where it is, still off the loop)
        gone = directory
    _later(shutil.rmtree, gone, True)


def removals_done(timeout: float | None = None) -> None:
    """Wait until every removal asked for so far has ended (the remover takes them in
    order): for a caller that needs their disk space back now. TimeoutError past
    ``timeout`` seconds."""
    _REMOVER.submit(lambda: None).result(timeout)


def _later(remove: Callable[..., None], *args: Any) -> None:
    """``remove(*args)`` on the remover's thread; here and now once the interpreter is
    shutting down (its threads take no more work then)."""
    try:
        _REMOVER.submit(remove, *args)
    except RuntimeError:
        remove(*args)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _stamp(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns


class SegmentFiles:
    """One tier's segments, in ``directory`` (made anew: a tier lives as long as its ps;
    restores come from checkpoints). Each segment holds handles of ``places`` (the tier's
    :class:`Places`) from when it is made until it goes."""

    def __init__(
        self,
        directory: str,
        dim: int,
        dtype: np.dtype,
        segment_rows: int,
        kernels: ModuleType,
        places: Places,
    ) -> None:
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.makedirs(directory)
        self.directory = directory
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.segment_rows = segment_rows
        self.kernels = kernels
        self.places = places
        self.segments: dict[int, Segment] = {}
        self.open: Segment | None = None  # the segment records are appended to
        self.next_number = 0  # the next segment's number

    def record(self, slots: tuple[str, ...]) -> np.dtype:
        """A record of a segment whose rows carry ``slots`` (:func:`record_dtype`)."""
        return record_dtype(self.dim, self.dtype, len(slots))

    def disk_bytes(self) -> int:
        return sum(seg.rows * self.record(seg.slots).itemsize for seg in self.segments.values())

    def path(self, number: int) -> str:
        return os.path.join(self.directory, f"{number}.rec")

    def file(self, seg: Segment) -> str:
        """Segment ``seg``'s file: ``<n>.rec``, or ``<n>.ref`` for a linked checkpoint file."""
        if seg.columns is None:
            return self.path(seg.number)
        return os.path.join(self.directory, f"{seg.number}.ref")

    # -- writing ----------------------------------------------------------------------------------
    def append(self, n: int, key_names: tuple[str, ...], pack: Callable[[slice], np.ndarray]) -> np.ndarray:
        """Records ``pack(part)`` for parts of ``range(n)`` (their rows carry ``key_names``),
        at the end of the open segment (opening new ones as they fill), ``WRITE_ROWS`` at a
        time; returns their places. On a full disk, ResourceExhaustedError and every segment
        as it was (bytes written past a segment's count are never read, and cut before the
        next write there)."""
        if not n:
            return np.empty(0, np.int64)
        placed: list[tuple[Segment, int, int]] = []  # (segment, first record, count)
        done = 0
        counts = {s.number: s.rows for s in self.segments.values()}
        opened: list[Segment] = []
        try:
            while done < n:
                seg = self.open
                if seg is None or seg.rows >= self.segment_rows or seg.slots != key_names:
                    seg = Segment(number=self.next_number + len(opened), slots=key_names)
                    self.places.take(seg.number, self.segment_rows)
                    opened.append(seg)
                    self.open = seg
                take = min(n - done, self.segment_rows - seg.rows, WRITE_ROWS)
                records = pack(slice(done, done + take))
                with open(self.path(seg.number), "ab") as f:
                    if f.tell() != seg.rows * records.itemsize:
                        f.truncate(seg.rows * records.itemsize)  # a failed write's tail
                        f.seek(0, os.SEEK_END)
                    f.write(records.data)
                placed.append((seg, seg.rows, take))
                seg.rows += take
                done += take
        except (OSError, ResourceExhaustedError) as exc:
            for seg in self.segments.values():
                seg.rows = counts[seg.number]
            self.open = None
            for seg in opened:
                self.delete_files(seg)
                self.places.give_back(seg.number)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhaustedError(
                    f"the table directory {self.directory} is full: {n} rows could not move to "
                    "disk (free some space, or give the ps a larger disk with --table-dir)"
                ) from None
            raise
        for seg in opened:
            self.segments[seg.number] = seg
        self.next_number += len(opened)
        return np.concatenate(
            [(np.int64(seg.number) << PLACE_BITS) + np.arange(first, first + k) for seg, first, k in placed]
        )

    def link(
        self,
        path: str,
        fd: int,
        rows: int,
        live: int,
        columns: dict[str, int],
        slots: tuple[str, ...],
        file_slots: dict[str, str | None] | None = None,
    ) -> int:
        """Hard-link checkpoint file ``path``, open as ``fd``, in as a segment of ``rows``
        records read by column (``columns``: see :class:`Segment`; ``slots`` sorted; its
        slots by their names in the file: ``file_slots``, see :class:`Segment`), ``live`` of
        which the tier will index (the others count dead from the start). Returns its
        number, for the places of its records (``number << PLACE_BITS | row``). OSError if
        the link cannot be made (another file system: the caller writes the rows instead) or
        is not to the file open (another swapped in under its name meanwhile)."""
        number = self.next_number
        link = self.file(Segment(number, columns={}))
        os.link(path, link, follow_symlinks=False)
        linked, held = os.stat(link, follow_symlinks=False), os.fstat(fd)
        if (linked.st_dev, linked.st_ino) != (held.st_dev, held.st_ino):
            os.unlink(link)
            raise OSError(errno.ESTALE, f"{path} is no longer the file read")
        try:
            self.places.take(number, rows)
        except ResourceExhaustedError:
            os.unlink(link)
            raise
        self.next_number += 1
        self.segments[number] = Segment(
            number,
            rows=rows,
            dead=rows - live,
            slots=slots,
            columns=columns,
            stamp=_stamp(held),
            file_slots=dict(file_slots or {}),
        )
        return number

    def linkable(self, directory: str, rename: dict[str, str]) -> list[tuple[int, str]]:
        """The linked segments (:meth:`link`) a full save written to ``directory``, its slots
        named by ``rename``, may link again rather than write their rows: ``(number, file)``
        of those on the same file system whose every slot it saves under the slot's name in
        the file (the file's rows then read as the save's own would)."""
        try:
            if os.stat(directory).st_dev != os.stat(self.directory).st_dev:
                return []
        except OSError:
            return []
        out = []
        for number, seg in sorted(self.segments.items()):
            if seg.columns is None or seg.file_slots is None:
                continue
            if not all(t is not None and rename.get(t) == k for k, t in seg.file_slots.items()):
                continue
            path = self.file(seg)
            try:  # (a file changed or gone from the tier meanwhile is not linked: its reads fail)
                if _stamp(os.stat(path, follow_symlinks=False)) != seg.stamp:
                    continue
            except OSError:
                continue
            out.append((number, path))
        return out

    # -- dead records, and the segments that go ----------------------------------------------------
    def died(self, places: np.ndarray) -> None:
        """Count the records at ``places`` dead in their segments (a count per segment
        number, no sort: the numbers of a tier's live segments lie close together)."""
        numbers = places >> PLACE_BITS
        low = int(numbers.min())
        counts = np.bincount(numbers - low)
        for k in np.flatnonzero(counts).tolist():
            self.segments[low + k].dead += int(counts[k])

    def collect(self) -> int:
        """Delete the segments whose every record is dead (not the one being written; the
        caller knows no save or read needs them). Returns how many."""
        gone = [s for s in self.segments.values() if s.dead >= s.rows and s is not self.open and s.rows]
        for seg in gone:
            del self.segments[seg.number]
            self.places.give_back(seg.number)
            # on a thread: unlinking a segment of 300 MB took 86 ms, on the serving loop (its
            # number is never given again, so nothing can take its name meanwhile)
            _later(_unlink, self.file(seg))
        return len(gone)

    def half_dead(self) -> int | None:
        """A segment at least half dead and not wholly (not the one being written), whose
        live records compaction may copy to the end; None if none."""
        for seg in self.segments.values():
            if seg is not self.open and seg.rows and 2 * seg.dead >= seg.rows and seg.dead < seg.rows:
                return seg.number
        return None

    def delete_files(self, seg: Segment) -> None:
        _unlink(self.file(seg))

    def forget(self) -> None:
        """Forget every segment (their directory goes with the tier)."""
        self.segments.clear()
        self.open = None

    # -- reading ----------------------------------------------------------------------------------
    def gather(
        self,
        number: int,
        records: np.ndarray,
        record: np.dtype,
        out: np.ndarray | None = None,
        missed: np.ndarray | None = None,
    ) -> np.ndarray:
        """Records ``records`` (ascending) of segment ``number`` (into ``out`` if given): a
        read per run of neighbouring records, many in flight through io_uring
        (``pread_records``), without the GIL (the serving loop goes on meanwhile). Read, not
        mapped: mapped pages of the page cache would count in the process's memory, large
        folios of them at a time. With ``missed`` (a byte a record), only the records the
        page cache holds, never waiting for the disk (``cached_records``: what the serving
        loop reads itself); the others are marked there, their rows of ``out`` not to be used
        (a linked checkpoint file's, read a column at a time, are all left to a thread)."""
        out = np.empty(records.size, record) if out is None else out
        if not records.size:
            return out
        seg = self.segments[number]
        if missed is not None and seg.columns is not None:
            missed[: records.size] = 1
            return out
        path = self.file(seg)
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = out.view(np.uint8).reshape(records.size, record.itemsize)
            if missed is not None:
                self.kernels.cached_records(fd, records, record.itemsize, raw, missed)
                return out
            if seg.columns is None:
                err = self.kernels.pread_records(fd, records, record.itemsize, raw)
            elif _stamp(os.fstat(fd)) != seg.stamp:
                raise DataLossError(
                    f"the checkpoint file a restore linked into this table's tier (its segment "
                    f"{number}) was written in place since (checkpoint files must not be changed "
                    "once saved): its rows are lost; restore the table again"
                )
            else:  # a linked checkpoint file: a read a column, each into its field
                err = self._gather_columns(fd, seg.columns, records, record, raw)
        finally:
            os.close(fd)
        if err:
            what = os.strerror(err) if err > 0 else "fewer records than its index says"
            raise OSError(err if err > 0 else errno.EIO, f"reading {path}: {what}")
        return out

    def _gather_columns(
        self, fd: int, columns: dict[str, int], records: np.ndarray, record: np.dtype, raw: np.ndarray
    ) -> int:
        """Records ``records`` of a linked file into ``raw`` (their bytes): each field from
        its column, a block of records at a time (the ``META`` fields 0). Returns the
        read's error, as ``pread_records``'s."""
        block = max(1, (1 << 20) // record.itemsize)
        fields = record.fields
        assert fields is not None
        start = fields["epoch"][1]
        for lo in range(0, records.size, block):
            part = records[lo : lo + block]
            into = raw[lo : lo + part.size]
            into[:, start : start + META.itemsize] = 0
            for field, at in columns.items():
                cell, first = fields[field][:2]
                got = np.empty((part.size, cell.itemsize), np.uint8)
                err = self.kernels.pread_records(fd, part, cell.itemsize, got, at)
                if err:
                    return int(err)
                into[:, first : first + cell.itemsize] = got
        return 0
