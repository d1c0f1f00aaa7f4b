"""The delta checkpoint format: what changed since a full checkpoint, in small files.

A delta ``<base>.delta-<K>`` of full checkpoint ``<base>`` is

* ``<base>.delta-<K>.ps<P>.safetensors``: what ps P changed since the save before
  (the base, or delta K-1), written by that ps (keys: ``server/ps/checkpoints/deltas.py``);
* ``<base>.delta-<K>.index.json``: written last, atomically, by the coordinator:
  ``format`` ``"pstrain-delta"``, the base's file name, ``delta`` K, ``seq`` (the
  save's version, counted over every save of the directory, full or delta), and
  for each variable path the parts written (``file``, ``key``, ``offset``,
  ``rows``, ``whole``), for each table path its ``prefix`` and ``files``.

The state at delta K is the base, then deltas 1..K applied in order; a delta
without its index, or after a missing one, does not exist. Variables: a delta's
rows overwrite the rows they name (by global row, so any number of parts reads
any other). Tables: a delta's ``removed`` ids are dropped, then its rows put in
(by id, so any number of ps reads any other). No network here; file I/O only.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import re
import threading
from collections.abc import Generator, Iterable, Iterator
from queue import Empty, Full, Queue
from typing import Annotated, Any, BinaryIO, NamedTuple, TypeVar

import msgspec
import numpy as np

from ..._base.errors import InvalidArgumentError, NotFoundError
from ..._kernels import KERNELS
from ..._kernels.id_index import IdIndex
from ..numerics.idhash import Shard, in_slices
from .checksums import checked_index, with_digest
from .table_links import linked_parts, rows_of
from .tensor_files import TensorFile, write_atomically

__all__ = [
    "DELTA_FORMAT",
    "SavedFile",
    "INDEX",
    "TablePlan",
    "TableState",
    "delta_prefix",
    "kept_by_later",
    "narrowed",
    "read_delta_index",
    "read_ahead",
    "read_table_plan",
    "split_delta",
    "write_delta_index",
]

DELTA_FORMAT = "pstrain-delta"
DELTA_VERSION = 1
#: The suffix of a checkpoint's index, full or delta (``checkpoint_files.py``).
INDEX = ".index.json"
_DELTA = re.compile(r"^(?P<base>.+)\.delta-(?P<k>[1-9][0-9]{0,8})$")

FileName = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[^/\\\x00]+$")]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=1100)]


class _Part(msgspec.Struct, forbid_unknown_fields=True):
    file: FileName
    key: Key
    offset: Annotated[int, msgspec.Meta(ge=0)]
    rows: Annotated[int, msgspec.Meta(ge=0)]
    whole: bool = False


class _Variable(msgspec.Struct, forbid_unknown_fields=True):
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    parts: list[_Part]
    trainable: bool = True
    name: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class _Table(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(max_length=1024)]
    prefix: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    files: list[FileName]
    rows: Annotated[int, msgspec.Meta(ge=0)] = 0
    removed: Annotated[int, msgspec.Meta(ge=0)] = 0
    key: Annotated[str, msgspec.Meta(max_length=1024)] = ""  # its name on the ps
    #: as the full save's entry has them (a delta of pstrain 0.2 has none): a table
    #: created after the base is read from the first delta that holds it
    dim: Annotated[int, msgspec.Meta(ge=1)] | None = None
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)] | None = None
    config: dict[str, Any] | None = None
    whole: bool = False  # every row of the table is here (it was made after the last mark)


class _DeltaIndex(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    version: int
    base: FileName
    delta: Annotated[int, msgspec.Meta(ge=1)]
    seq: Annotated[int, msgspec.Meta(ge=0)]
    time: float = 0.0
    variables: dict[str, _Variable] = {}
    tables: dict[str, _Table] = {}
    bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: ps -> [incarnation, mark]: the delta's composed state holds every change up to them
    marks: dict[str, tuple[str, int]] = {}


def delta_prefix(base: str, number: int) -> str:
    """The prefix of delta ``number`` of checkpoint ``base``.

    >>> delta_prefix("/tmp/run/ckpt-3", 2)
    '/tmp/run/ckpt-3.delta-2'
    """
    return f"{base}.delta-{number}"


def split_delta(path: str) -> tuple[str, int] | None:
    """``(base prefix, K)`` if ``path`` names a delta (``<base>.delta-<K>``), else None.

    >>> split_delta("/tmp/run/ckpt-3.delta-2"), split_delta("/tmp/run/ckpt-3")
    (('/tmp/run/ckpt-3', 2), None)
    """
    m = _DELTA.match(path.removesuffix(INDEX))
    return (m.group("base"), int(m.group("k"))) if m else None


def write_delta_index(prefix: str, index: dict[str, Any]) -> None:
    """Write the index of delta ``prefix`` atomically (temp file, fsync, rename); checked first."""
    checked = msgspec.convert({"format": DELTA_FORMAT, "version": DELTA_VERSION, **index}, _DeltaIndex)
    body = with_digest(msgspec.to_builtins(checked))

    def write(f: BinaryIO) -> None:
        f.write(json.dumps(body).encode())

    write_atomically(prefix + INDEX, write, overwrite=False)


def read_delta_index(prefix: str) -> dict[str, Any]:
    """The index of delta ``prefix``, checked (schema, format, file names)."""
    path = prefix + INDEX
    try:
        with open(path, "rb") as f:
            raw = json.load(f)
    except FileNotFoundError as exc:
        raise NotFoundError(f"no delta checkpoint at {prefix} (missing {path})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"delta index {path} is damaged: {exc}") from exc
    raw = checked_index(path, raw)
    try:
        index = msgspec.convert(raw, _DeltaIndex)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"delta index {path} is malformed: {exc}") from None
    if index.format != DELTA_FORMAT or index.version != DELTA_VERSION:
        raise InvalidArgumentError(
            f"{path} is not a pstrain delta (format {index.format!r}, version {index.version})"
        )
    return msgspec.to_builtins(index)


#: A table's rows: ids, rows, slots by key, the slots' initial values.
TableState = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, float]]


T = TypeVar("T")

#: Threads a restore's plan reads the ids of a base's and its deltas' files with (each
#: read waits on the disk more than it works: W9's ten deltas were read in a quarter less
#: time on 4 threads than on one; 2 threads gave half that, 8 no more than 4).
PLAN_THREADS = 4


def kept_by_later(
    put: list[np.ndarray], removed: list[np.ndarray], at_most: int | None = None
) -> tuple[list[np.ndarray], IdIndex]:
    """Which of each delta's ids (``put[k]``, distinct; ``removed[k]``, the ids it removes)
    the deltas composed keep: those no later delta put again or removed (removed then put
    by one delta: put); and every id the deltas put or remove, in an index (:func:`has`
    asks it). The last delta first, each id looked up once in a hash index of the ids the
    later ones touched (the tables' own, their rows left 0): RAM for
    the ids they touch, not for every id they name (a chain of deltas that each changed
    most of a table names it many times over). (Sorted arrays merged after each delta cost
    a sort of every id seen so far a delta: 60 ms of a 0.3 s restore of ten deltas of
    21,000 ids.) The index is made for the largest delta's ids, or for every id named up to
    ``at_most`` (the ids the caller expects the deltas to touch at most: a restore knows
    its shard's), and grows past that if need be: each growth puts every id in again, in
    memory the ps has not touched yet."""
    sizes = [ids.size + gone.size for ids, gone in zip(put, removed, strict=True)]
    seen = IdIndex(max(1, max(sizes, default=0) if at_most is None else min(sum(sizes), at_most)))
    keep = []
    for ids, gone in zip(reversed(put), reversed(removed), strict=True):
        kept = ~has(seen, ids)
        keep.append(kept)
        _add(seen, ids[kept])
        if gone.size:  # (after its own puts: an id it removed then put is counted once)
            gone = np.unique(gone)
            _add(seen, gone[~has(seen, gone)])
    return keep[::-1], seen


def has(index: IdIndex, ids: np.ndarray) -> np.ndarray:
    """Whether each of ``ids`` is in ``index``, looked up ``CHECK_BLOCK`` at a time (a base's
    ids are tens of millions: a row for each of them all at once is a temporary array that
    size)."""
    found = np.empty(ids.size, bool)
    for lo in range(0, ids.size, CHECK_BLOCK):
        np.greater_equal(index.get(ids[lo : lo + CHECK_BLOCK]), 0, out=found[lo : lo + CHECK_BLOCK])
    return found


def _add(index: IdIndex, ids: np.ndarray) -> None:
    """Put ``ids`` (distinct, none in ``index`` yet) in, their rows 0."""
    index.insert(ids, np.zeros(ids.size, np.int64))


#: Ids a check of a base's ids (:func:`has`, :func:`_repeats`) takes at a time: a restore's base holds
#: tens of millions, and each temporary array of them all is memory the ps has not touched
#: yet, which costs more on first use than the check itself.
CHECK_BLOCK = 1 << 20
#: Parts a base's ids are checked for repeats in, a hash set per part in turn.
REPEAT_PARTS = 16


def _repeats(ids: np.ndarray) -> bool:
    """Whether an id comes twice in ``ids``: each of ``REPEAT_PARTS`` parts of them (a part
    by a hash of the id) sorted in turn, a copy of that part alone, and its neighbours
    compared: 8 bytes an id of a part besides the ids (a hash set of them costs 40 to 80,
    which for a base of millions of ids is a restore's largest array)."""
    if ids.size <= CHECK_BLOCK:
        return _sorted_repeats(np.sort(ids))
    which = np.empty(ids.size, np.uint8)
    for lo in range(0, ids.size, CHECK_BLOCK):
        which[lo : lo + CHECK_BLOCK] = KERNELS.shard_ids(ids[lo : lo + CHECK_BLOCK], REPEAT_PARTS, 0)
    for part in range(REPEAT_PARTS):
        some = ids[which == part]
        some.sort()
        if _sorted_repeats(some):
            return True
    return False


def _sorted_repeats(ids: np.ndarray) -> bool:
    """Whether sorted ``ids`` hold an id twice (compared ``CHECK_BLOCK`` at a time)."""
    return any(
        bool(np.any(ids[lo + 1 : lo + CHECK_BLOCK + 1] == ids[lo : min(lo + CHECK_BLOCK, ids.size - 1)]))
        for lo in range(0, max(0, ids.size - 1), CHECK_BLOCK)
    )


def _shard_ids(
    get: Any,
    keys: set[str],
    what: str,
    shard: Shard,
    num_shards: int,
    link: tuple[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a saved table (``get(key)`` reads its tensors, named ``keys``; ``what``
    names it) and which of them are shard ``shard``'s and live; InvalidArgumentError if it
    is not a saved table. ``link``: the file is one a full save's file links (that file's
    path and its bits of this one's rows, which replace the file's own ``live``)."""
    if not {"ids", "rows"} <= keys:
        raise InvalidArgumentError(f"dyn/restore: {what} is not a saved dynamic table (no ids and rows)")
    ids = get("ids")
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise InvalidArgumentError(f"dyn/restore: ids in {what} are not 1-D int64")
    mine = in_slices(ids, num_shards, shard)
    if link is not None:
        return ids, mine & rows_of(what, ids, link[1], link[0])
    if "live" in keys:  # rows handed out and evicted since are not the table's
        live = get("live")
        if live.dtype != np.bool_ or live.shape != ids.shape:
            raise InvalidArgumentError(f"dyn/restore: live in {what} is {live.dtype} {live.shape}")
        mine &= live
    return ids, mine


def _joined(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    """``parts`` end to end: the one part itself if only one is not empty (a restore onto
    as many ps reads rows from one file per ps: a copy of them cost as much as the read)."""
    full = [p for p in parts if p.shape[0]]
    if len(full) == 1:
        return full[0]
    return np.concatenate(full) if full else empty


# -- a restore that streams the base ------------------------------------------------------------
class SavedFile(NamedTuple):
    """A file of a save with rows of the shard to restore (a full save's, or a delta's: its
    tensors named with ``prefix``): which of its rows are kept (the shard's, live, and put
    again or removed by no later delta), their ids, and its slots."""

    path: str
    keep: np.ndarray
    ids: np.ndarray
    slots: tuple[str, ...]
    #: The file read (device, inode, size, last change): a reader opening it again by its
    #: name checks that it is still the file whose ids were read.
    identity: tuple[int, int, int, int]
    prefix: str = ""


#: Bytes of each tensor a restore reads at a time (:meth:`TablePlan.pieces`).
PIECE_BYTES = 4 << 20


class TablePlan:
    """A saved table's rows for one shard, planned before any is read: the files of the
    base and of each delta, and which of their rows the deltas composed keep (each id's
    last put; the base's rows no delta put again or removed), to be read a piece at a time
    (:meth:`pieces`; a tiered table writes them as they come) or into arrays made once
    (:meth:`read_whole`). A plan holds the ids of the rows it keeps, 8 bytes a row, and a
    mask of each file's rows."""

    def __init__(
        self,
        base: list[SavedFile],
        deltas: list[SavedFile],
        slot_init: dict[str, float],
        dim: int,
        dtype: np.dtype,
    ) -> None:
        self.base = base
        #: The deltas' files, the first delta's first.
        self.deltas = deltas
        self.slot_init = slot_init
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.slots = sorted(set().union(*(f.slots for f in (*base, *deltas))))
        self.delta_rows = int(sum(f.ids.size for f in deltas))
        self.rows = int(sum(f.ids.size for f in base)) + self.delta_rows

    def pieces(
        self, piece_bytes: int = PIECE_BYTES
    ) -> Generator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]], None, None]:
        """``(ids, rows, slots)`` of every row: the deltas' first, the last delta's first
        (the rows training changed last, which a tiered table keeps in RAM as far as its
        budget lets it: it takes the first rows for RAM), then the base's kept rows, about
        ``piece_bytes`` of each tensor at a time (each checked against its checksums as it
        is read; a slot a file lacks: its initial value)."""
        yield from self.delta_pieces(piece_bytes)
        for part in self.base:
            yield from self.file_pieces(part, piece_bytes)

    def delta_pieces(
        self, piece_bytes: int = PIECE_BYTES
    ) -> Iterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
        """The deltas' kept rows, the last delta's first (:meth:`file_pieces`)."""
        for part in reversed(self.deltas):
            if part.ids.size:
                yield from self.file_pieces(part, piece_bytes)

    def file_pieces(
        self, part: SavedFile, piece_bytes: int = PIECE_BYTES, f: TensorFile | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
        """The kept rows of file ``part`` (:meth:`part_pieces`), read from ``f`` if it is
        given (the file open already), else from the file opened again."""
        try:
            if f is not None:
                yield from self.part_pieces(f, part, piece_bytes)
                return
            with self.reopen(part) as opened:
                yield from self.part_pieces(opened, part, piece_bytes)
        except OSError as exc:
            raise InvalidArgumentError(f"dyn/restore: cannot read {part.path}: {exc}") from exc

    def nbytes(self, slots: int | None = None) -> int:
        """The bytes of the shard's ids, rows and ``slots`` of its slots (all by default), as
        :meth:`read_whole` makes them."""
        per_row = self.dim * self.dtype.itemsize
        return self.rows * (8 + per_row * (1 + (len(self.slots) if slots is None else slots)))

    @property
    def held_nbytes(self) -> int:
        """The bytes the plan holds until its rows are read: the ids it keeps and each
        file's mask."""
        return int(sum(f.ids.nbytes + f.keep.nbytes for f in (*self.base, *self.deltas)))

    def with_slots(self, slots: Iterable[str]) -> TablePlan:
        """This plan with ``slots`` of its slots only: the others are neither read nor made."""
        names = set(slots)
        out = copy.copy(self)
        out.slots = [k for k in self.slots if k in names]

        def only(parts: list[SavedFile]) -> list[SavedFile]:
            return [part._replace(slots=tuple(k for k in part.slots if k in names)) for part in parts]

        out.base, out.deltas = only(self.base), only(self.deltas)
        return out

    def read_whole(self, slots: Iterable[str] | None = None) -> TableState:
        """Every row in RAM (the base's kept rows file by file, then the deltas' in order;
        as applying the deltas one by one leaves them) with ``slots`` of the slots (all by
        default): each array made once at its size and filled a piece at a time, so that
        the shard is never held twice (read, then composed) and the caller knows before any
        row is read how much it holds (:meth:`nbytes`)."""
        plan = self if slots is None else self.with_slots(slots)
        names = plan.slots
        n, shape = self.rows, (self.rows, self.dim)
        ids = np.empty(n, np.int64)
        rows = np.empty(shape, self.dtype)
        out = {k: np.empty(shape, self.dtype) for k in names}
        at = 0
        for part in (*plan.base, *(d for d in plan.deltas if d.ids.size)):
            for p_ids, p_rows, p_slots in plan.file_pieces(part):
                end = at + p_ids.size
                ids[at:end] = p_ids
                rows[at:end] = p_rows
                for k in names:
                    out[k][at:end] = p_slots[k]
                at = end
        if at != n:  # pragma: no cover - the plan counts what its pieces give
            raise InvalidArgumentError(f"dyn/restore: planned {n} rows, read {at}")
        return ids, rows, out, dict(self.slot_init)

    @staticmethod
    def reopen(part: SavedFile) -> TensorFile:
        """File ``part`` opened again; InvalidArgumentError if it is no longer the file whose
        ids were read (another under its name)."""
        f = TensorFile(part.path)
        if _identity(f.fileno()) != part.identity:
            f.close()
            raise InvalidArgumentError(f"dyn/restore: {part.path} changed while it was restored")
        return f

    def part_pieces(
        self, f: TensorFile, part: SavedFile, piece_bytes: int = PIECE_BYTES
    ) -> Iterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]]:
        """The kept rows of file ``part`` (open as ``f``), about ``piece_bytes`` of each
        tensor at a time (each checked against its checksums as it is read, unless ``f``
        checked it through already; a slot the file lacks: its initial value)."""
        piece_rows = max(1, piece_bytes // (self.dim * self.dtype.itemsize))
        # each tensor read on a thread of its own, a piece ahead (the disk reads them side by
        # side: W9's restores of a base and ten deltas ran at 0.62-0.74x a plain read,
        # against 0.60-0.67x read one after the other; a large base's took up to 33 MiB more
        # RAM, as fast)
        streams = [
            read_ahead(f.iter_rows(part.prefix + key, part.keep, self.dtype, piece_rows), 1)
            for key in ("rows", *(f"slot:{k}" for k in part.slots))
        ]
        try:
            done = 0
            for got in zip(*streams, strict=True):
                n = got[0].shape[0]
                ids = part.ids[done : done + n]
                done += n
                slots = dict(zip(part.slots, got[1:], strict=True))
                for k in self.slots:
                    if k not in slots:
                        slots[k] = np.full((n, self.dim), self.slot_init[k], self.dtype)
                yield ids, got[0], slots
        finally:  # (their threads stopped before the file closes, however this ends)
            for stream in streams:
                stream.close()


def _identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _saved_file(
    f: TensorFile, path: str, prefix: str, keys: set[str], ids: np.ndarray, keep: np.ndarray, dim: int
) -> SavedFile:
    """File ``path`` (open as ``f``; its tensors ``keys``, named without ``prefix``) as a
    plan holds it: its rows' and slots' shapes checked against its ids."""
    slots = tuple(sorted(k[5:] for k in keys if k.startswith("slot:")))
    for key in ("rows", *(f"slot:{k}" for k in slots)):
        shape = f.tensors[prefix + key].shape
        if shape != (ids.size, dim):
            what = f"{path}{' ' + prefix if prefix else ''}"
            raise InvalidArgumentError(
                f"dyn/restore: {key} in {what} is {shape}, expected ({ids.size}, {dim})"
            )
    return SavedFile(path, keep, ids, slots, _identity(f.fileno()), prefix)


def _base_part(
    path: str, shard: Shard, num_shards: int, dim: int
) -> tuple[list[SavedFile], dict[str, float]]:
    """A file of a full save, for :func:`read_table_plan`: its ids, which of them are the
    shard's and live (``keep``; no delta considered yet), and its slots; and the same of
    each file it links (``table_links.py``), each with the rows the save took from it;
    those with none of the shard's left out. And its slots' initial values."""
    slot_init: dict[str, float] = {}
    out: list[SavedFile] = []
    todo: list[tuple[str, tuple[str, np.ndarray] | None]] = [(path, None)]
    while todo:
        name, link = todo.pop(0)
        try:
            with TensorFile(name) as f:
                keys = set(f.tensors)
                ids, keep = _shard_ids(f.read, keys, name, shard, num_shards, link)
                if link is None:  # its links after it; the initial values its own
                    todo += [(p, (name, m)) for p, m in linked_parts(name, keys, f.read)]
                    for key in sorted(keys):
                        if key.startswith("init:"):
                            slot_init[key[5:]] = float(f.read(key).reshape(-1)[0])
                if keep.any():  # (none of the shard's: its rows are not read)
                    out.append(_saved_file(f, name, "", keys, ids, keep, dim))
        except OSError as exc:
            raise InvalidArgumentError(f"dyn/restore: cannot read {name}: {exc}") from exc
    return out, slot_init


def _delta_parts(
    delta: list[tuple[str, str]], shard: Shard, num_shards: int, dim: int
) -> tuple[list[SavedFile], np.ndarray, dict[str, float]]:
    """A delta's files (each ``(file, prefix)``), for :func:`read_table_plan`: each file's
    ids, which of them are the shard's and live (``keep``; no later delta considered yet),
    and its slots, those with none of the shard's left out (no row is read); the ids the
    delta removes from the shard; its slots' initial values."""
    out: list[SavedFile] = []
    removed_parts = [np.empty(0, np.int64)]
    slot_init: dict[str, float] = {}
    for path, prefix in delta:
        try:
            with TensorFile(path) as f:
                keys = {k[len(prefix) :] for k in f.tensors if k.startswith(prefix)}

                def get(key: str, f: Any = f, prefix: str = prefix) -> np.ndarray:
                    return f.read(prefix + key)

                what = f"{path}{' ' + prefix if prefix else ''}"
                ids, keep = _shard_ids(get, keys, what, shard, num_shards)
                if "removed" in keys:
                    removed = get("removed")
                    if removed.dtype != np.int64 or removed.ndim != 1:
                        raise InvalidArgumentError(f"dyn/restore: removed in {path} is not 1-D int64")
                    removed_parts.append(removed[in_slices(removed, num_shards, shard)])
                for key in sorted(keys):
                    if key.startswith("init:"):
                        slot_init[key[5:]] = float(get(key).reshape(-1)[0])
                if keep.any():  # (none of the shard's: its rows are not read)
                    out.append(_saved_file(f, path, prefix, keys, ids, keep, dim))
        except OSError as exc:
            raise InvalidArgumentError(f"dyn/restore: cannot read {path}: {exc}") from exc
    return out, np.concatenate(removed_parts), slot_init


def narrowed(mask: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``mask`` with only ``keep`` (one per true entry of it) of its true entries left true:
    a file's rows of a shard, narrowed to those the later saves did not touch."""
    out = mask.copy()
    out[mask] = keep
    return out


def _kept(part: SavedFile, keep: np.ndarray) -> SavedFile:
    """``part`` keeping only ``keep`` of the rows it kept (one per kept row)."""
    mask = narrowed(part.keep, keep)
    return part._replace(keep=mask, ids=part.ids[mask])


def read_table_plan(
    base_files: list[str],
    deltas: list[list[tuple[str, str]]],
    shard: Shard,
    num_shards: int,
    dim: int,
    dtype: np.dtype,
) -> TablePlan:
    """The rows of a saved table that shard ``shard`` of ``num_shards`` holds, planned: the
    full save's files (from any number of ps, and the files they link), then each delta
    (its ``(file, prefix)`` pairs) applied in order, its removed ids dropped, its rows put
    in. No row is read here: the ids of every file are read and checked, and which rows of
    each file the shard keeps is planned (see :class:`TablePlan`). Every check of the whole
    read is made here, before a row goes anywhere, but for the rows' checksums, checked as
    :meth:`TablePlan.pieces` reads them. (The deltas' rows were once read whole and
    composed first: a tiered ps restoring deltas of 100,000 rows held them all in RAM, 14
    times its budget; and a table read whole was held twice, read and composed.)"""

    def plan_delta(delta: list[tuple[str, str]]) -> Any:
        return _delta_parts(delta, shard, num_shards, dim)

    # the files' ids side by side (PLAN_THREADS)
    with concurrent.futures.ThreadPoolExecutor(PLAN_THREADS, "pstrain-restore-read") as pool:
        base_reads = [pool.submit(_base_part, path, shard, num_shards, dim) for path in base_files]
        planned = list(pool.map(plan_delta, deltas))
        base_parts = [read.result() for read in base_reads]
    put = []  # each delta's ids of the shard, its files' end to end
    for parts, _, _ in planned:
        ids = _joined([part.ids[part.keep] for part in parts], np.empty(0, np.int64))
        if KERNELS.unique_first(ids)[0].size != ids.size:
            raise InvalidArgumentError("dyn/restore: an id appears twice in the saved shards")
        put.append(ids)
    # (the deltas touch about as many ids as the shard holds at most, unless it grew)
    in_base = sum(int(part.keep.sum()) for parts, _ in base_parts for part in parts)
    keeps, seen = kept_by_later(put, [removed for _, removed, _ in planned], max(in_base, *map(len, put), 1))
    delta_files: list[SavedFile] = []
    for (parts, _, _), keep in zip(planned, keeps, strict=True):
        at = 0
        for part in parts:
            n = int(part.keep.sum())
            delta_files.append(_kept(part, keep[at : at + n]))
            at += n
    slot_init: dict[str, float] = {}
    base: list[SavedFile] = []
    for parts, part_init in base_parts:
        slot_init.update(part_init)
        for part in parts:  # its rows no delta put again or removed
            gone = has(seen, part.ids)
            keep = part.keep & ~gone
            ids = part.ids if not gone.any() and keep.all() else part.ids[keep]  # (no copy of them all)
            base.append(part._replace(keep=keep, ids=ids))
    for _, _, delta_init in planned:  # (the deltas' initial values win, as when composed whole)
        slot_init.update(delta_init)
    # the composed deltas hold each id once, and the base's rows kept none of theirs: only
    # the base's own ids can repeat (within a file or across the files of its ps)
    if _repeats(_joined([f.ids for f in base], np.empty(0, np.int64))):
        raise InvalidArgumentError("dyn/restore: an id appears twice in the saved shards")
    plan = TablePlan(base, delta_files, slot_init, dim, dtype)
    if set(plan.slots) - set(slot_init):
        raise InvalidArgumentError("dyn/restore: a slot's initial value was not saved")
    return plan


def read_ahead(items: Iterator[T], depth: int = 2) -> Generator[T, None, None]:
    """``items``, produced on a thread of their own up to ``depth`` ahead of the reader (a
    restore reads the next piece of its base while it writes the last one to disk). An
    error producing them is raised to the reader; a reader that stops early stops the
    producer at its next item."""
    queue: Queue[tuple[bool, Any]] = Queue(depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        queue.put((True, item), timeout=0.1)
                        break
                    except Full:
                        continue
                if stop.is_set():
                    return
            queue.put((False, None))
        except BaseException as exc:  # (to the reader)
            queue.put((False, exc))

    thread = threading.Thread(target=produce, name="pstrain-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            more, item = queue.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # (it may wait to put one more: take it)
            try:
                queue.get(timeout=0.1)
            except Empty:
                pass
