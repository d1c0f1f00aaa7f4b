"""A tiered shard restored from a checkpoint: the base's files linked in, not written again.

A tiered restore used to read every row of the base and write the rows past the hot set
to the tier's own segments: as many bytes written as read, on the cores that also serve.
Here, a base file on the tier's own file system, of which this shard keeps at least half
the rows, is hard-linked into the tier as a segment read by column
(:meth:`~pstrain.server.ps.tables.cold_segments.SegmentFiles.link`); the restore reads it through
once against its checksums (damage is an error before anything is served, as for a
restore that copies), reads the rows the hot set takes from it, and indexes the others
where they lie. Nothing of it is written. The check runs beside the rest of the restore
(the files read from disk while the table fills on another core), which ends once it
has. The deltas' rows go first to RAM, and past the hot set to the tier's segments, as
before; so do the rows of a file that cannot be linked (another file system, another
dtype, or mostly rows of other shards).

A linked file is never written (checkpoint files are not once named, nor are segments);
it shares its blocks with the checkpoint, so deleting the checkpoint frees them only once
the tier's rows there have died or been compacted away.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...._formats.files.delta_files import PIECE_BYTES, TablePlan, read_ahead
from ...._formats.files.tensor_files import CHECK_READ
from .cold_places import MaskedPlaces

if TYPE_CHECKING:
    from ...._formats.files.delta_files import SavedFile
    from ...._formats.files.tensor_files import TensorFile
    from .tiered_table import TieredTable

__all__ = ["fill_from_plan"]

logger = logging.getLogger(__name__)

Piece = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]

#: Records of a file a scan of which it keeps looks at a time.
SCAN_BLOCK = 1 << 20
#: Threads that read the linked files' tensors through against their checksums (a tensor
#: each: the disk reads them side by side, as a restore that copies reads them), while the
#: table fills.
CHECK_THREADS = 4
#: What each of them reads at a time at least (at most ``CHECK_READ``: together, a save's
#: block, a share of the budget).
MIN_CHECK_READ = 64 << 10


def fill_from_plan(
    table: TieredTable, plan: TablePlan, names: dict[str, str], slot_init: dict[str, float], hot: int
) -> int:
    """Fill ``table`` (made anew, not served yet: on a thread) with ``plan``'s rows, the
    first ``hot`` in RAM, the base's files linked where they can be (see the module
    docstring); ``names`` maps saved slots to the table's. Returns the rows left where
    they lie in linked files."""
    room = max(0, hot - plan.delta_rows)
    linked: list[tuple[TensorFile, SavedFile, np.ndarray, MaskedPlaces]] = []
    parts: list[tuple[SavedFile, TensorFile | None]] = []
    try:
        for part in plan.base:
            take = min(room, part.ids.size)
            room -= take
            got = _link(table, plan, part, names, take)
            if got is None:
                parts.append((part, None))
            else:
                f, in_ram, ids, places = got
                linked.append((f, part, ids, places))
                parts.append((in_ram, f))

        def pieces() -> Iterator[Piece]:  # (a save's blocks at most: a share of the budget)
            piece = min(PIECE_BYTES, table.save_block_bytes)
            for ids, rows, slots in read_ahead(_pieces(plan, parts, piece)):
                yield ids, rows, {names[k]: v for k, v in slots.items() if k in names}

        left = sum(ids.size for _, _, ids, _ in linked)
        # the linked files are read through against their checksums while the table fills
        # (its reads of them check nothing twice); the restore ends only once they are:
        # the table is served after, never a row of a damaged file
        with concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, "pstrain-restore-check") as pool:
            checks = []
            step = min(CHECK_READ, max(MIN_CHECK_READ, table.save_block_bytes // CHECK_THREADS))
            for f, part, _, _ in linked:
                keys = ("rows", *(f"slot:{k}" for k in part.slots))
                f.checked_alongside(keys)
                checks += [pool.submit(f.check, key, step) for key in keys]
            try:
                table.fill_pieces(
                    pieces(), plan.rows - left, slot_init, hot, linked=[(ids, at) for _, _, ids, at in linked]
                )
            except BaseException:
                _raise_damage(checks)  # a damaged file is the cause to report, not what it did
                raise
            for check in checks:
                check.result()
        return left
    finally:
        for f, *_ in linked:
            f.close()


def _raise_damage(checks: list[concurrent.futures.Future[None]]) -> None:
    """The first of ``checks`` that failed raises its error (once each has ended)."""
    for check in checks:
        if check.exception() is not None:
            raise check.exception()  # type: ignore[misc]


def _pieces(
    plan: TablePlan, parts: list[tuple[SavedFile, TensorFile | None]], piece_bytes: int
) -> Iterator[Piece]:
    """``plan``'s pieces of about ``piece_bytes``, each base file's from ``parts``: a linked
    one's rows for RAM alone, read from the file it was linked from (checked through
    already)."""
    yield from plan.delta_pieces(piece_bytes)
    for part, f in parts:
        if f is None or part.ids.size:
            yield from plan.file_pieces(part, piece_bytes, f=f)


def _link(
    table: TieredTable, plan: TablePlan, part: SavedFile, names: dict[str, str], in_ram: int
) -> tuple[TensorFile, SavedFile, np.ndarray, MaskedPlaces] | None:
    """Link base file ``part`` into ``table``'s tier past its first ``in_ram`` kept rows:
    (the file open, the part of it still to read for RAM, the ids left on disk and their
    places); None where it cannot be (the caller copies its rows)."""
    if 2 * part.ids.size < part.keep.size or part.ids.size <= in_ram:
        return None  # mostly other shards' rows (or all of it for RAM): copied
    f = plan.reopen(part)
    got = None
    try:
        got = _linked(table, f, part, names, in_ram)
    finally:
        if got is None:  # (not linked, or failed: the file is not kept open)
            f.close()
    return None if got is None else (f, *got)


def _linked(
    table: TieredTable, f: TensorFile, part: SavedFile, names: dict[str, str], in_ram: int
) -> tuple[SavedFile, np.ndarray, MaskedPlaces] | None:
    """:func:`_link` of the file open as ``f``."""
    tensors = f.tensors
    if any(tensors[k].dtype != table.dtype for k in ("rows", *(f"slot:{k}" for k in part.slots))):
        return None
    slots = sorted(names[k] for k in part.slots if k in names)
    columns = {"id": tensors["ids"].at, "row": tensors["rows"].at}
    for k in part.slots:
        if k in names:
            columns[f"slot{slots.index(names[k])}"] = tensors[f"slot:{k}"].at
    try:
        number = table.cold.files.link(
            part.path,
            f.fileno(),
            part.keep.size,
            part.ids.size - in_ram,
            columns,
            tuple(slots),
            {k: names.get(k) for k in part.slots},
        )
    except OSError as exc:
        logger.info("restore of %r copies %s: it cannot be linked (%s)", table.name, part.path, exc)
        return None
    cut = _after_first(part.keep, in_ram)  # (the records past it stay on disk)
    head = part.keep.copy()
    head[cut:] = False
    places = MaskedPlaces(number, part.keep, cut)  # (made a block at a time as indexed)
    return part._replace(keep=head, ids=part.ids[:in_ram]), part.ids[in_ram:], places


def _after_first(mask: np.ndarray, n: int) -> int:
    """The position just past the ``n``-th set element of ``mask`` (0 if ``n`` is 0),
    counted a block at a time (no array of every set position)."""
    seen = 0
    for lo in range(0, mask.size, SCAN_BLOCK):
        if seen >= n:
            return lo
        part = mask[lo : lo + SCAN_BLOCK]
        count = int(np.count_nonzero(part))
        if seen + count >= n:
            return lo + int(np.flatnonzero(part)[n - seen - 1]) + 1
        seen += count
    return mask.size
