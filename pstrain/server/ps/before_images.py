"""What a rerun of an exactly-once closure reads: the values its dead attempt read.

An attempt that dies (its worker killed, cut off, declared lost) may have applied some of
its updates and not others: one ps took its ``opt/apply`` and the other never got it, or
it got through its first operation only. The rerun's updates skip what was applied
(``fencing.py``); but were it to read the variables afresh, it would compute the rest
from values the dead attempt's updates had already changed, and the job would end in
another state than a run without the fault.

So a ps keeps, for each variable and table it holds, the values from before the latest
exactly-once closure changed it (the *before image*: the rows it changed, or the whole
array; a table's rows by id), and a read sent by an attempt of that same closure before
the operation that first changed it (``as_of = [key, operations begun]``, filled in by
the channel, :func:`~pstrain._base.tags.read_tags`) gets those values. A rerun so reads
what its first attempt read, computes the same updates, and the ones the first attempt
did not apply are applied as it would have applied them. The first attempt itself never
meets an image: it reads before its own operations.

Bounds: one image per variable or table, at most its size (the rows a closure changed,
merged over its operations, each row's value from before the closure's first change of
it). Any update of another closure, or outside exactly-once closures, drops the image: a
rerun then reads the current values. A variable or table replaced (a restore, a move,
a new coordinator's creation) has no image. A closure that changes one variable in
several operations and reads it between them reads, on a rerun, the values from before
its first change, or, once it has begun that operation, the current values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._base.tags import OP_PREFIX
from ..._kernels.batches import take_rows
from .fencing import changed
from .store import VariableStore
from .tables.dynamic_table import DynamicTable

__all__ = ["BeforeImages"]

#: Captures between two sweeps for images of what left this ps.
SWEEP_EVERY = 1024


@dataclass
class _Image:
    key: str  # the exactly-once closure whose changes it undoes
    first: int  # its operation that first changed the variable here
    holder: Any  # the VariableRecord or DynamicTable it belongs to (replaced: no image)
    rows: np.ndarray | None  # the rows (ids, for a table) it holds, ascending; None: all
    values: np.ndarray
    after: Any = None  # a variable's array once changed (another array: replaced since)
    #: The arrays ``values`` and ``rows`` are the start of (the next image of the variable
    #: reuses them: memory already touched, not a fresh allocation each update).
    memory: tuple[np.ndarray, np.ndarray | None] | None = None


class BeforeImages:
    """The before images of one ps's variables (``store``) and tables (``tables``)."""

    def __init__(self, store: VariableStore, tables: Mapping[str, DynamicTable]) -> None:
        self.store = store
        self.tables = tables
        self._images: dict[str, _Image] = {}
        self._captures = 0

    def __len__(self) -> int:
        return len(self._images)

    @property
    def nbytes(self) -> int:
        return sum(
            sum(a.nbytes for a in i.memory if a is not None)
            if i.memory is not None
            else i.values.nbytes + (i.rows.nbytes if i.rows is not None else 0)
            for i in self._images.values()
        )

    # -- updates ------------------------------------------------------------------------------
    def capture(self, once: tuple[str, int] | None, req: Any) -> Callable[[], None] | None:
        """Before ``req`` (an update sent with ``once``) is applied: returns what to call once
        it has been, which keeps the values it is about to change (an exactly-once closure's)
        or drops the images of what it changes (another's)."""
        key = once[0] if once is not None and not once[0].startswith(OP_PREFIX) else None
        if key is None and not self._images:
            return None  # nothing kept, nothing to keep: no exactly-once closures here
        self._captures += 1
        if not self._captures % SWEEP_EVERY:
            self.sweep()
        variables, tables = changed(req)
        names = [name for name, _ in variables] + [name for name, _ in tables]
        if key is None:
            return lambda: self._drop(names)
        assert once is not None
        # an image per variable and table, over every change of the request (one name may
        # change twice), put in place once the request applied
        pending: dict[str, _Image | None] = {}
        try:
            for name, rows in variables:
                pending[name] = self._take(name, rows, key, once[1], pending)
            for name, ids in tables:
                pending[name] = self._take_rows(name, ids, key, once[1], pending)
        except (ValueError, TypeError, IndexError, OverflowError):
            # rows or ids no update takes (strings, say): the update's own checks refuse it
            # by name; its variables keep no image
            return lambda: self._drop(names)

        def applied() -> None:
            for name, image in pending.items():
                if image is None:
                    self._images.pop(name, None)
                    continue
                if not isinstance(image.holder, DynamicTable):
                    image.after = image.holder.array
                self._images[name] = image

        return applied

    def _prior(self, name: str, key: str, holder: Any, pending: dict[str, _Image | None]) -> _Image | None:
        """The image of ``name`` this closure's change of it adds to, if any."""
        image = pending[name] if name in pending else self._images.get(name)
        if image is None or image.key != key or image.holder is not holder:
            return None
        return image if name in pending or self._valid(name, image) else None

    def _valid(self, name: str, image: _Image) -> bool:
        """Whether ``image`` still undoes the latest change of what ``name`` is here (not
        moved away, deleted, replaced, or restored since)."""
        if isinstance(image.holder, DynamicTable):
            return self.tables.get(name) is image.holder
        record = self.store.find(name)
        return record is image.holder and record is not None and image.after is record.array

    def _take(
        self, name: str, rows: np.ndarray | None, key: str, seq: int, pending: dict[str, _Image | None]
    ) -> _Image | None:
        record = self.store.find(name)
        if record is None:
            return None
        arr = record.array
        if rows is not None and arr.ndim == 0:
            rows = None  # (rows of a scalar: the update refuses them)
        if rows is not None:
            rows = _ascending(rows)
            if rows.size and (rows[0] < 0 or rows[-1] >= (arr.shape[0] if arr.ndim else 0)):
                rows = rows[(rows >= 0) & (rows < (arr.shape[0] if arr.ndim else 0))]
        image = self._prior(name, key, record, pending)
        if image is None:
            return self._fresh(name, _Image(key, seq, record, rows, arr), arr, rows)
        if image.rows is None:
            return image  # every row's value from before the closure's first change is kept
        if rows is None:  # now the whole array: the kept rows as they were, the others now
            values = arr.copy()
            values[image.rows] = image.values
            return _Image(key, image.first, record, None, values)
        new = np.setdiff1d(rows, image.rows, assume_unique=True)
        return _merged(image, new, arr[new]) if new.size else image

    def _take_rows(
        self, name: str, ids: np.ndarray, key: str, seq: int, pending: dict[str, _Image | None]
    ) -> _Image | None:
        table = self.tables.get(name)
        if table is None:
            return None
        ids = _ascending(ids)
        image = self._prior(name, key, table, pending)
        if image is not None and image.rows is not None:
            ids = np.setdiff1d(ids, image.rows, assume_unique=True)
        pos = table.positions(ids)
        held = pos >= 0
        ids, pos = ids[held], pos[held]
        if image is None:
            return self._fresh(name, _Image(key, seq, table, ids, table.rows), table.rows, pos)
        return _merged(image, ids, table.rows[pos]) if ids.size else image

    def _fresh(self, name: str, image: _Image, source: np.ndarray, take: np.ndarray | None) -> _Image:
        """``image`` with its values: ``source`` whole (``take`` None) or its rows ``take``,
        copied into the memory of the image it replaces where they fit. That image goes now
        (its memory is overwritten): if the update then fails, the variable has none."""
        old = self._images.pop(name, None)
        memory = old.memory if old is not None else None
        if take is None:
            values = memory[0] if memory is not None and memory[1] is None else None
            if values is None or values.shape != source.shape or values.dtype != source.dtype:
                values = np.empty_like(source)
            np.copyto(values, source)
            image.values, image.memory = values, (values, None)
            return image
        assert image.rows is not None
        n = image.rows.size
        buf, rows_buf = memory if memory is not None and memory[1] is not None else (None, None)
        if (
            buf is None
            or rows_buf is None
            or buf.shape[0] < n
            or buf.shape[1:] != source.shape[1:]
            or buf.dtype != source.dtype
        ):
            cap = n + n // 4 + 16  # room for the next update's rows, a few more or less
            buf, rows_buf = np.empty((cap, *source.shape[1:]), source.dtype), np.empty(cap, np.int64)
        take_rows(source, take, buf[:n])  # (compiled for float rows, the next ones prefetched)
        rows_buf[:n] = image.rows
        image.values, image.rows, image.memory = buf[:n], rows_buf[:n], (buf, rows_buf)
        return image

    def sweep(self) -> None:
        """Drop the images of variables and tables no longer here (moved to another ps,
        deleted, replaced): their memory goes with them."""
        for name, image in list(self._images.items()):
            if not self._valid(name, image):
                del self._images[name]

    def _drop(self, names: list[str]) -> None:
        for name in names:
            self._images.pop(name, None)

    # -- reads --------------------------------------------------------------------------------
    def _for(self, name: str, as_of: Any, holder: Any) -> _Image | None:
        """The image a read ``as_of`` of ``name`` gets, if any."""
        if as_of is None or not self._images:
            return None
        image = self._images.get(name)
        if image is None or image.key != as_of[0] or as_of[1] >= image.first or image.holder is not holder:
            return None
        if self._valid(name, image):
            return image
        del self._images[name]  # its array was replaced (a restore): the image is stale
        return None

    def whole(self, name: str, as_of: Any, array: np.ndarray) -> np.ndarray:
        """Variable ``name`` (now ``array``) as a read ``as_of`` sees it."""
        image = self._for(name, as_of, self.store.find(name))
        if image is None:
            return array
        if image.rows is None:
            return image.values.copy()  # (its memory is the next image's)
        out = array.copy()
        out[image.rows] = image.values
        return out

    def rows(self, name: str, as_of: Any, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of variable ``name`` (now ``values``) as a read ``as_of`` sees them."""
        image = self._for(name, as_of, self.store.find(name))
        if image is None:
            return values
        if image.rows is None:
            return image.values[np.asarray(rows, np.int64)]
        return _patched(image, np.asarray(rows, np.int64), values)

    def table_rows(self, name: str, as_of: Any, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Table ``name``'s rows of ``ids`` (now ``values``) as a read ``as_of`` sees them."""
        image = self._for(name, as_of, self.tables.get(name))
        return values if image is None else _patched(image, np.asarray(ids, np.int64), values)


def _ascending(keys: Any) -> np.ndarray:
    """``keys`` (rows or ids) distinct and ascending, as int64 (as they come: no sort)."""
    keys = np.asarray(keys).reshape(-1).astype(np.int64, copy=False)
    if keys.size > 1 and not bool(np.all(keys[1:] > keys[:-1])):
        keys = np.unique(keys)
    return keys


def _merged(image: _Image, rows: np.ndarray, values: np.ndarray) -> _Image:
    """``image`` with more rows (none of them in it), ascending."""
    assert image.rows is not None
    merged = np.concatenate([image.rows, rows])
    order = np.argsort(merged, kind="stable")
    return _Image(
        image.key, image.first, image.holder, merged[order], np.concatenate([image.values, values])[order]
    )


def _patched(image: _Image, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` (of rows or ids ``keys``) with those the image holds from it."""
    assert image.rows is not None
    if not image.rows.size or not keys.size:
        return values
    at = np.minimum(np.searchsorted(image.rows, keys), image.rows.size - 1)
    hit = image.rows[at] == keys
    if not hit.any():
        return values
    out = np.array(values, copy=True)
    out[hit] = image.values[at[hit]]
    return out
