"""A large array as it was when a save began, read block by block while training changes it.

A checkpoint save (full or delta) does not pin a large array (an update would copy it
whole: a 3 GB table doubled). It takes a :class:`Snapshot`: the save's writer thread walks
the array (or a delta's changed rows) in blocks of about ``BLOCK_BYTES``, copying one block
at a time to write it; an update first keeps the old values of the rows it changes in
blocks not yet written (copy-on-write per row, the rows it touches and no others), and the
writer puts those back into its copy of the block. The file holds the array exactly as it
was when the save began; the memory a save adds is one block plus the rows updated during
it (kept in one log, :class:`KeptRows`, which grows by doubling: at most twice those rows).

The writer's side costs CPU on the cores training runs on, so it is kept small: a writer
gathers each block straight into the file writer's staging buffer
(:meth:`Snapshot.write_to`: no block copied twice, no fresh pages to fault in per block),
rows by the compiled kernel, and the serving loop's side (:meth:`Snapshot.before_write`,
once per update while a save runs) is one lookup per row, with no search and no sort: in a
byte per row for a full save; for a delta, of the row's epoch, in the same compiled pass
that keeps the rows it must (:meth:`KeptRows.add_changed`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np

from ...._formats.files.direct_writes import DirectWriter
from ...._kernels import FLOAT_DTYPES, KERNELS
from ...._kernels.batches import take_rows

__all__ = ["BLOCK_BYTES", "ChangedRows", "KeptRows", "Snapshot"]

#: About how many bytes a save's writer copies (and writes) at a time (less on a ps under
#: a memory budget: ``Tiering.save_bytes``).
BLOCK_BYTES = 8 << 20


def _rows_in(array: np.ndarray, block_bytes: int) -> int:
    """Rows of ``array`` in a block of about ``block_bytes`` (one at least)."""
    return max(1, block_bytes // max(1, array[:1].nbytes))


class KeptRows:
    """Old values of rows of ``array``, each row kept at most once, in the order kept: one
    log of row numbers and one of values, grown by doubling (an update's rows go in with
    one gather, not as an entry of their own that the writer would search one by one).

    >>> a = np.arange(8.0).reshape(4, 2)
    >>> kept = KeptRows(a)
    >>> kept.add(np.array([3, 1]))
    >>> r, v = kept.between(0, 2)
    >>> r.tolist(), v.tolist()
    ([1], [[2.0, 3.0]])
    >>> kept.drop_below(2); kept.rows().tolist()
    [3]
    """

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._rows = np.empty(0, np.int64)
        self._values = np.empty((0, *array.shape[1:]), array.dtype)
        self._n = 0

    @property
    def nbytes(self) -> int:
        return self._n * self.array[:1].nbytes

    def rows(self) -> np.ndarray:
        """The rows kept (a view: read it under the snapshot's lock)."""
        return self._rows[: self._n]

    def add(self, rows: np.ndarray) -> None:
        """Keep the current values of ``rows`` (none of them kept already)."""
        n = self._reserve(rows.size)
        end = n + rows.size
        self._rows[n:end] = rows
        take_rows(self.array, rows, self._values[n:end])
        self._n = end

    def add_changed(self, rows: np.ndarray, epochs: np.ndarray, since: int, mark: int, taken: int) -> bool:
        """Keep the current values of those of ``rows`` (int64, strictly ascending: a sparse
        step's) in ``taken:`` whose epoch is in ``(since, mark]``, in one compiled pass with
        no temporary per row; False, nothing kept, where the rows are not strictly ascending
        or the array's dtype is not one the kernel takes (the caller keeps them another way)."""
        arr = self.array
        if arr.dtype not in FLOAT_DTYPES or arr.ndim < 1:
            return False
        n = self._reserve(rows.size)
        width = math.prod(arr.shape[1:])
        got = KERNELS.keep_changed(
            rows,
            epochs,
            since,
            mark,
            taken,
            arr.reshape(arr.shape[0], width),
            self._rows,
            self._values.reshape(self._rows.size, width),
            n,
        )
        if got < 0:
            return False
        self._n = n + got
        return True

    def between(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows kept in ``lo:hi`` and their old values (copies)."""
        rows = self._rows[: self._n]
        at = np.flatnonzero((rows >= lo) & (rows < hi))
        return rows[at], self._values[at]

    def drop_below(self, upto: int) -> None:
        """Forget the rows below ``upto``; give the memory back once most of it is unused."""
        rows = self._rows[: self._n]
        stay = np.flatnonzero(rows >= upto)
        if stay.size == self._n:
            return
        self._rows[: stay.size] = rows[stay]
        self._values[: stay.size] = self._values[stay]
        self._n = stay.size
        if self._rows.size > 4 * max(self._n, 1024):
            self._resize(max(2 * self._n, 1024))

    def _reserve(self, count: int) -> int:
        """Room for ``count`` more rows (the log grows by doubling); returns where they go."""
        if self._n + count > self._rows.size:
            self._resize(max(self._n + count, 2 * self._rows.size, 1024))
        return self._n

    def _resize(self, capacity: int) -> None:
        rows = np.empty(capacity, np.int64)
        values = np.empty((capacity, *self.array.shape[1:]), self.array.dtype)
        rows[: self._n] = self._rows[: self._n]
        values[: self._n] = self._values[: self._n]
        self._rows, self._values = rows, values


class Snapshot:
    """One array as it was when a save began, read block by block while it keeps changing.

    >>> a = np.arange(10.0).reshape(5, 2)
    >>> snap = Snapshot(a, block_rows=2)
    >>> snap.before_write(np.array([4, 0]))   # the serving loop, before it changes rows 0 and 4
    >>> a[[0, 4]] = -1.0
    >>> np.concatenate(list(snap.blocks())).ravel().tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    """

    def __init__(
        self,
        array: np.ndarray,
        block_rows: int | None = None,
        rows: np.ndarray | None = None,
        *,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self._setup(array, block_rows or _rows_in(array, block_bytes), rows)
        # True: nothing to keep for the row (kept already, or not among the rows selected).
        if rows is None:
            self._done = np.zeros(self.rows, bool)
        else:
            self._done = np.ones(self.rows, bool)
            self._done[rows] = False

    def _setup(self, array: np.ndarray, block_rows: int, rows: np.ndarray | None) -> None:
        self.array = array
        self.rows = array.shape[0]
        #: Only these rows (ascending), gathered in order (a delta's changed rows); None: all.
        self.select = rows
        self.block_rows = block_rows
        self.taken = 0  # rows below this are copied by the writer: changes there need nothing
        self._kept = KeptRows(array)  # old values of rows changed before the writer took them
        self._next_drop = self.block_rows * 64  # the writer forgets kept rows it is past
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes of old values kept now (rows changed before the writer took them)."""
        return self._kept.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what it writes: the array's, or its selected rows'."""
        count = self.rows if self.select is None else self.select.size
        return (count, *self.array.shape[1:])

    def before_write(self, rows: np.ndarray | None) -> None:
        """The serving loop is about to change ``rows`` (None: every row): keep their old
        values where the writer has not copied them yet."""
        with self._lock:
            if self.taken >= self.rows:
                return
            if rows is None:
                r = np.arange(self.taken, self.rows)
            else:
                r = np.asarray(rows).reshape(-1)
                r = r[(r >= self.taken) & (r < self.rows)]  # rows past the snapshot: not its
            r = self._to_keep(r, rows is None)
            if not r.size:
                return
            if r.size > 1 and not bool(np.all(r[1:] > r[:-1])):  # a sparse step's rows are
                r = np.unique(r)  # unique and ascending
            self._kept.add(r)

    def _to_keep(self, r: np.ndarray, every: bool) -> np.ndarray:
        """Of rows ``r`` (at or past ``taken``; ``every``: all of them), those whose old values
        are still to be kept, now counted as kept."""
        r = r[~self._done[r]]
        self._done[r] = True
        return r

    def blocks(self) -> Iterator[np.ndarray]:
        """The array (or its selected rows) as of the snapshot, one block (a copy of its
        own) at a time."""
        count = self.rows if self.select is None else self.select.size
        for lo in range(0, count, self.block_rows):
            hi = min(count, lo + self.block_rows)
            yield self._block(lo, hi, None)
            self._maybe_drop(hi)
        self._drop_written(self.rows)

    def between(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of the snapshot (of its selected rows) as they were when it began,
        a copy of their own, for a reader that takes them in order from the first, a block
        at a time, as :meth:`blocks` does (a move's copy, pulled by another ps)."""
        block = self._block(lo, hi, None)
        self._maybe_drop(hi)
        return block

    def write_to(self, writer: DirectWriter) -> int:
        """Write the array (or its selected rows) as of the snapshot to ``writer``, each
        block gathered straight into the writer's staging buffer (no copy of its own, then
        a second into the buffer); returns the bytes written."""
        arr = self.array
        row_bytes = arr[:1].nbytes
        count = self.rows if self.select is None else self.select.size
        lo = 0
        while lo < count:
            room = writer.room()
            aligned = room.ctypes.data % arr.itemsize == 0
            fits = room.size // row_bytes if row_bytes and aligned else 0
            hi = min(count, lo + self.block_rows, lo + max(1, fits) if aligned else count)
            if fits:
                dest = room[: (hi - lo) * row_bytes].view(arr.dtype).reshape(hi - lo, *arr.shape[1:])
                self._block(lo, hi, dest)
                writer.wrote(dest.nbytes)
            else:  # a row across the buffer's end, or a start not aligned: a copy of its own
                writer.write(self._block(lo, hi, None))
            self._maybe_drop(hi)
            lo = hi
        self._drop_written(self.rows)
        return count * row_bytes

    def _block(self, lo: int, hi: int, out: np.ndarray | None) -> np.ndarray:
        """Rows ``lo:hi`` of the snapshot (of the selected rows) as they were when it began,
        into ``out`` (a fresh array if None)."""
        select = self.select
        # Copied without the lock (the serving loop's updates do not wait for it): a row
        # changed meanwhile is past `taken`, so its old values are kept first and put back.
        if select is None:
            if out is None:
                block = self.array[lo:hi].copy()
            else:
                block = out
                np.copyto(block, self.array[lo:hi])
            first, last = lo, hi
        else:
            picked = select[lo:hi]
            block = take_rows(self.array, picked, out)
            first, last = int(picked[0]), int(picked[-1]) + 1
        with self._lock:
            self.taken = last
            r, v = self._kept.between(first, last)
        if r.size:
            block[r - lo if select is None else np.searchsorted(picked, r)] = v
        return block

    def _maybe_drop(self, hi: int) -> None:
        if hi >= self._next_drop:  # every 64 blocks or so
            self._next_drop = hi + self.block_rows * 64
            self._drop_written(self.taken)

    def _drop_written(self, upto: int) -> None:
        """Forget kept rows the writer is past (memory back while the save goes on)."""
        with self._lock:
            self._kept.drop_below(upto)


class ChangedRows(Snapshot):
    """The rows of ``array`` whose epoch in ``epochs`` is after ``since`` and not after
    ``mark`` (a delta's rows, ``mark`` just taken: no row is stamped after it yet), as they
    were at the mark, found by the writer (:meth:`prepare`), not by the serving loop.

    Taking it costs the serving loop nothing per row: the rows are found by a pass over
    the epochs on the writer's thread, while updates go on. Whoever changes rows calls
    :meth:`before_write` first, then stamps them with the current epoch (after ``mark``):
    a row still stamped in ``(since, mark]`` is one of the delta's rows not changed since
    the mark, so its old values are kept the first time, and only then (its stamp moves on).

    Why the writer's pass finds exactly the rows: it reads each row's epoch at some moment
    without the lock. A row of the delta not yet changed then is found (its stamp is still
    in the range); one changed before was kept before its stamp moved on, so it is among
    the rows kept, taken under the lock after the pass. A row found, or kept, is one of the
    delta's: stamps only ever move past ``mark``.

    >>> a = np.arange(10.0).reshape(5, 2)
    >>> epochs = np.array([1, 3, 2, 3, 0], np.uint32)     # changed since mark 1: rows 1, 2, 3
    >>> snap = ChangedRows(a, epochs, since=1, mark=3)
    >>> snap.before_write(np.array([2])); a[2] = -1.0; epochs[2] = 4   # an update meanwhile
    >>> snap.prepare().tolist()
    [1, 2, 3]
    >>> np.concatenate(list(snap.blocks())).ravel().tolist()
    [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """

    def __init__(
        self,
        array: np.ndarray,
        epochs: np.ndarray,
        since: int,
        mark: int,
        block_rows: int | None = None,
        *,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self._setup(array, block_rows or _rows_in(array, block_bytes), None)
        if epochs.shape[0] != self.rows:
            raise ValueError(f"ChangedRows: {epochs.shape[0]} epochs for {self.rows} rows")
        self.epochs = epochs
        self.since = since
        self.mark = mark
        self._every_kept = False  # every row still to write was kept (an update of them all)

    def before_write(self, rows: np.ndarray | None) -> None:
        # A sparse step's rows (int64, strictly ascending): kept by one compiled pass.
        if (
            rows is not None
            and isinstance(rows, np.ndarray)
            and rows.dtype == np.int64
            and rows.ndim == 1
            and rows.flags.c_contiguous
        ):
            with self._lock:
                if self.taken >= self.rows or self._every_kept:
                    return
                if self._kept.add_changed(rows, self.epochs, self.since, self.mark, self.taken):
                    return
        super().before_write(rows)

    def _to_keep(self, r: np.ndarray, every: bool) -> np.ndarray:
        if self._every_kept:
            return r[:0]
        if every:
            self._every_kept = True  # the rows' stamps do not move: keep them once, now
        e = self.epochs[r]
        return r[(e > self.since) & (e <= self.mark)]

    def prepare(self) -> np.ndarray:
        """Find the rows (on the writer's thread, before the first block); returns them."""
        found = KERNELS.rows_after(self.epochs, self.since, until=self.mark)
        with self._lock:
            k = np.sort(self._kept.rows())
        if k.size:
            pos = np.searchsorted(found, k)
            there = pos < found.size
            there[there] = found[pos[there]] == k[there]
            missing = k[~there]
            if missing.size:
                found = np.insert(found, np.searchsorted(found, missing), missing)
        self.select = found
        return found
