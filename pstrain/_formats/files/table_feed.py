"""The serving feed's reading: what one ps's shard of a table changed since a version,
from the checkpoints and deltas of one directory.

A *version* is a save's ``seq`` (unique in its directory, full or delta,
``_checkpoint/deltas.py``). The feed follows one *chain*: the base and deltas
``1..K`` of the newest save (highest ``seq``) that holds the table. A reader
that last got version ``s`` gets, in order of preference:

(A delta whose base's index is not written yet is not a version yet.)

1. ``s`` is the chain's last version: nothing (the same version again).
2. ``s`` is a save of the chain: the deltas after it, composed.
3. ``s`` is a save of an older chain (before a compaction): the rest of that
   chain's deltas, then the chain's deltas whose marks are after the last of them,
   if that last one's mark on this ps is at least the chain's base's (same
   incarnation throughout, no table restore since ``s``). A compaction writes a
   delta and gives the new base that delta's marks (``Checkpoint.write_compacted``),
   so a reader crosses it without a full read. Every row changed after ``s`` is
   sent (a few changed before may be sent again, with their last values: putting
   them in again changes nothing).
4. Otherwise (no ``s``, a save no longer there, a restarted ps, a restore since,
   slices of the table moved to or from this ps since ``s``): a *reset*: the whole
   shard (the slices this ps holds now) at the chain's last version.

Either way the reply names the chain's last version, which the reader sends next
time. No network here; file I/O only.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._base.errors import FailedPreconditionError, InvalidArgumentError, PstrainError
from ..numerics.idhash import Shard, in_slices
from .checkpoint_files import read_index
from .delta_files import INDEX, kept_by_later, narrowed, read_delta_index, split_delta
from .table_links import linked_parts, rows_of
from .tensor_files import TensorFile

__all__ = ["FeedReply", "IndexCache", "read_feed"]

logger = logging.getLogger(__name__)


@dataclass
class FeedReply:
    """One answer of the feed: apply ``removed`` then ``ids``/``rows`` (or, on a reset,
    replace everything with ``ids``/``rows``), then ask again since ``version``.

    The rows are not in memory: :meth:`iter_rows` reads them from the save files, held
    open here (a save pruned meanwhile stays readable), in the order of ``ids``, a bounded
    piece at a time. :meth:`close` lets the files go."""

    version: int
    reset: bool
    ids: np.ndarray
    removed: np.ndarray
    dim: int
    dtype: np.dtype
    #: (file, rows key, which of its rows are sent), in the order of ``ids``
    sources: list[tuple[TensorFile, str, np.ndarray]] = field(default_factory=list)
    files: list[TensorFile] = field(default_factory=list)

    @property
    def rows_nbytes(self) -> int:
        return int(self.ids.size) * self.dim * self.dtype.itemsize

    def iter_rows(self, piece_rows: int = 1 << 12) -> Iterator[np.ndarray]:
        """The rows, ``[k, dim]`` pieces of ``dtype`` in the order of ``ids``."""
        for tensor_file, key, keep in self.sources:
            yield from tensor_file.iter_rows(key, keep, self.dtype, piece_rows)

    def close(self) -> None:
        for tensor_file in self.files:
            tensor_file.close()
        self.files = []


@dataclass(frozen=True)
class _Save:
    seq: int
    base: str  # the base's prefix
    number: int  # 0: the base itself
    entry: dict[str, Any]  # the table's entry in the index
    mark: tuple[str, int] | None  # this ps's [incarnation, mark]


#: One directory's parsed indexes by path, each with the (inode, mtime) it was read at: an
#: index is never written over, so a reader polling every few seconds parses each one once.
IndexCache = dict[str, tuple[tuple[int, int], dict[str, Any] | None]]


def _index(path: str, cache: IndexCache) -> dict[str, Any] | None:
    """The index at ``path`` (full or delta), checked; None if it is not a pstrain save."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None  # removed meanwhile
    stamp = (st.st_ino, st.st_mtime_ns)
    held = cache.get(path)
    if held is not None and held[0] == stamp:
        return held[1]
    prefix = path[: -len(INDEX)]
    try:
        index: dict[str, Any] | None = read_delta_index(prefix) if split_delta(prefix) else read_index(prefix)
    except InvalidArgumentError as exc:  # damaged, or not a pstrain save: not a version (said once)
        logger.warning("table feed: %s is not a version: %s", path, exc)
        index = None
    except PstrainError:
        index = None  # removed meanwhile
    cache[path] = (stamp, index)
    return index


def _saves(
    directory: str, key: str, ps: int, cache: IndexCache, confine: Confine
) -> tuple[dict[int, _Save], set[str]]:
    """The saves of ``directory`` that hold table ``key`` (its name on the ps), by version;
    and the full saves (their prefixes) that do not: a table made after one of them is in
    its deltas from the first that holds it whole."""
    found: dict[int, _Save] = {}
    without: set[str] = set()
    paths = glob.glob(os.path.join(glob.escape(directory), "*" + INDEX))
    for gone in set(cache) - set(paths):
        cache.pop(gone, None)
    for path in paths:
        confine(path)  # a link out of the root is refused, never read
        index = _index(path, cache)
        if index is None:
            continue
        entry = next(
            (e for e in index.get("tables", {}).values() if (e.get("key") or e.get("name")) == key), None
        )
        split = split_delta(path[: -len(INDEX)])
        if entry is None:
            if split is None:
                without.add(path[: -len(INDEX)])
            continue
        mark = index.get("marks", {}).get(str(ps))
        found[int(index.get("seq", 0))] = _Save(
            int(index.get("seq", 0)),
            split[0] if split else path[: -len(INDEX)],
            split[1] if split else 0,
            entry,
            (str(mark[0]), int(mark[1])) if mark else None,
        )
    return found, without


def _chain(saves: dict[int, _Save], newest: _Save, without: set[str]) -> list[_Save] | None:
    """The base and deltas 1..K of save ``newest`` (for a table made after the base, the
    deltas from the first that holds it whole); None if one's index is missing (a base is
    published after its first delta, ``deltas.publish_caught_up``: for a moment that delta
    is there and its base's index is not)."""
    by_number = {s.number: s for s in saves.values() if s.base == newest.base}
    first = 0
    if 0 not in by_number and newest.base in without:
        first = min(by_number)
        if not by_number[first].entry.get("whole"):
            return None
    chain = []
    for number in range(first, newest.number + 1):
        save = by_number.get(number)
        if save is None:
            return None
        chain.append(save)
    return chain


def _newest_chain(saves: dict[int, _Save], without: set[str]) -> list[_Save]:
    """The chain of the newest save (highest ``seq``) that is whole."""
    for seq in sorted(saves, reverse=True):
        chain = _chain(saves, saves[seq], without)
        if chain is not None:
            return chain
    raise FailedPreconditionError("table feed: no save of the table is whole yet (a base's index is missing)")


def _after(since: _Save, saves: dict[int, _Save], chain: list[_Save], reset_at: int) -> list[_Save] | None:
    """The deltas that hold every change after save ``since``, another chain's (rule 3 of
    the module docstring): the rest of ``since``'s own chain, then the deltas of ``chain``
    after its last save's marks; None if that cannot be known."""
    mine = sorted(
        (s for s in saves.values() if s.base == since.base and s.number > since.number),
        key=lambda s: s.number,
    )
    bridge = []
    for k, save in enumerate(mine, since.number + 1):  # contiguous from ``since``
        if save.number != k:
            break
        bridge.append(save)
    last = bridge[-1] if bridge else since
    path = [since, *bridge, *chain]
    if since.mark is None or since.mark[1] < reset_at:
        return None
    if any(s.mark is None or s.mark[0] != since.mark[0] for s in path):
        return None
    assert last.mark is not None and chain[0].mark is not None
    if last.mark[1] < chain[0].mark[1]:
        return None
    return [*bridge, *(s for s in chain[1:] if s.mark is not None and s.mark[1] > last.mark[1])]


#: Resolves a path the feed is about to read, or raises: a ps confines every file to its
#: checkpoint root (``server/ps/checkpoints/saves.py``), the same check its restores make.
Confine = Callable[[str], str]


#: One file of a save: the file, its rows' key, its ids, and which of them this shard holds.
_SavedFile = tuple[TensorFile, str, np.ndarray, np.ndarray]


def _open_save(
    directory: str, save: _Save, confine: Confine, held: list[TensorFile], shard: Shard, num_shards: int
) -> tuple[list[_SavedFile], np.ndarray]:
    """The files of one save of the table, opened (kept in ``held``), with the ids of each
    and which of them this shard holds; and the save's removed ids of this shard."""
    out: list[_SavedFile] = []
    removed_parts = []
    prefix = save.entry["prefix"] + ":" if save.number else ""
    # each file, then the files it links (a full save's: ``table_links.py``)
    todo: list[tuple[str, tuple[str, np.ndarray] | None]] = [
        (confine(os.path.join(directory, name)), None) for name in save.entry["files"]
    ]
    while todo:
        path, link = todo.pop(0)
        tensor_file = TensorFile(path)
        held.append(tensor_file)
        keys = tensor_file.tensors
        if prefix + "ids" not in keys or prefix + "rows" not in keys:
            raise InvalidArgumentError(
                f"table feed: {path} is not a saved dynamic table"
                f"{' ' + prefix if prefix else ''} (no ids and rows)"
            )
        ids = tensor_file.read(prefix + "ids")
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise InvalidArgumentError(f"table feed: ids in {path} are not 1-D int64")
        mine = in_slices(ids, num_shards, shard)
        if link is not None:  # its rows the linking file took: its own live and links aside
            mine &= rows_of(path, ids, link[1], link[0])
            tensor_file.check("rows")
            out.append((tensor_file, "rows", ids, mine))
            continue
        if not prefix:
            todo[:0] = [(confine(p), (path, m)) for p, m in linked_parts(path, keys, tensor_file.read)]
        if prefix + "live" in keys:  # rows handed out and evicted since are not the table's
            live = tensor_file.read(prefix + "live")
            if live.dtype != np.bool_ or live.shape != ids.shape:
                raise InvalidArgumentError(f"table feed: live in {path} is {live.dtype} {live.shape}")
            mine &= live
        if prefix + "removed" in keys:
            removed = tensor_file.read(prefix + "removed")
            if removed.dtype != np.int64 or removed.ndim != 1:
                raise InvalidArgumentError(f"table feed: removed in {path} is not 1-D int64")
            removed_parts.append(removed[in_slices(removed, num_shards, shard)])
        tensor_file.check(prefix + "rows")  # damage is a refusal now, not a reply cut short
        out.append((tensor_file, prefix + "rows", ids, mine))
    mine_ids = np.concatenate([ids[mine] for _, _, ids, mine in out]) if out else np.empty(0, np.int64)
    if np.unique(mine_ids).size != mine_ids.size:
        raise InvalidArgumentError(f"table feed: an id appears in two files of save {save.seq}")
    return out, np.concatenate(removed_parts) if removed_parts else np.empty(0, np.int64)


def _compose(
    directory: str, saves: list[_Save], confine: Confine, reply: FeedReply, shard: Shard, num_shards: int
) -> None:
    """Fill ``reply`` with what ``saves`` (in order) leave in the shard: each row from the
    last save that put its id in, unless a later one removed it; ``removed``, the ids
    removed and not put in again."""
    opened = [_open_save(directory, s, confine, reply.files, shard, num_shards) for s in saves]
    puts = [np.concatenate([np.empty(0, np.int64), *(i[m] for *_, i, m in files)]) for files, _ in opened]
    keeps, _ = kept_by_later(puts, [removed for _, removed in opened])  # (as a restore composes)
    sources: list[tuple[TensorFile, str, np.ndarray]] = []
    id_parts: list[np.ndarray] = []
    for (files, _), kept in zip(opened, keeps, strict=True):  # (each save's files, the last first)
        ends = np.cumsum([int(mine.sum()) for *_, mine in files])
        for (tensor_file, key, ids, mine), hi in zip(reversed(files), reversed(ends)):
            keep = narrowed(mine, kept[hi - int(mine.sum()) : hi])
            sources.append((tensor_file, key, keep))
            id_parts.append(ids[keep])
    reply.sources = sources
    reply.ids = np.concatenate([np.empty(0, np.int64), *id_parts])
    removed_all = np.empty(0, np.int64)
    if not reply.reset:
        for files, removed in opened:
            put = np.concatenate([ids[mine] for _, _, ids, mine in files] or [np.empty(0, np.int64)])
            removed_all = np.union1d(removed_all[~np.isin(removed_all, put)], removed)
    reply.removed = removed_all


def read_feed(
    directory: str,
    key: str,
    ps: int,
    shard: Shard,
    num_shards: int,
    dim: int,
    dtype: np.dtype,
    since: int | None,
    reset_at: int = 0,
    cache: IndexCache | None = None,
    moved_at: int = 0,
    confine: Confine = os.path.realpath,
) -> FeedReply:
    """What shard ``shard`` of ``num_shards`` of table ``key`` changed since version
    ``since`` (None: everything), read from ``directory`` (the rules: module docstring).
    ``ps`` is this ps's number in the saves' marks; ``reset_at`` the mark before which this
    ps's table was last replaced (a restore): older marks are not comparable. ``cache``
    keeps this directory's parsed indexes between calls; ``moved_at`` the mark from which
    this ps holds other slices of the table (a reader's copy from before is reset).
    ``confine`` resolves every path read, or refuses it. The reply holds its files open
    until it is closed; its rows are read as they are sent."""
    saves, without = _saves(directory, key, ps, {} if cache is None else cache, confine)
    if not saves:
        raise FailedPreconditionError(
            f"table feed: no save of table {key!r} in {directory} yet: the feed serves saved "
            "versions (CheckpointManager(..., delta_interval_s=...))"
        )
    chain = _newest_chain(saves, without)
    version = chain[-1].seq
    empty = np.empty(0, np.int64)
    if since == version:
        return FeedReply(version, False, empty, empty, dim, np.dtype(dtype))
    deltas: list[_Save] | None = None
    if since is not None and since in saves and (saves[since].mark or ("", -1))[1] < moved_at:
        since = None  # saved before this ps's slices changed: the reader's copy is reset
    position = next((i for i, s in enumerate(chain) if s.seq == since), None)
    if position is not None:
        deltas = chain[position + 1 :]
    elif since is not None and since in saves:
        deltas = _after(saves[since], saves, chain, reset_at)
    reply = FeedReply(version, deltas is None, empty, empty, dim, np.dtype(dtype))
    try:
        _compose(directory, chain if deltas is None else deltas, confine, reply, shard, num_shards)
    except BaseException:
        reply.close()
        raise
    return reply
