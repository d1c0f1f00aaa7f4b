"""The coordinator's side of delta checkpoints: marks, delta files and their index.

A :class:`Chain` is what the next delta extends: its full checkpoint (the
base), the last delta written on it, the version (``seq``) of its last save,
and for each ps the mark (incarnation, epoch) that save covers. Versions are
unique in a directory (:func:`next_seq`) and taken as a save starts; each index
records its marks, which the ps's serving feed compares (``server/ps/checkpoints/feed.py``). A full save
takes the marks *before* it starts (a change after the mark may also be in the
save: the next delta writes it again, never loses it); a restore takes them
after. :func:`write_delta` asks each ps for what changed since its mark
(``delta/save``, ``server/ps/checkpoints/deltas.py``), then writes the delta's index last,
atomically; only then does the chain move on. A delta that fails leaves no
index (its files are removed) and the chain where it was, so the next one
carries its rows too. Formats: ``_formats/files/delta_files.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.context import current_channels
from .._base.errors import FailedPreconditionError, InvalidArgumentError
from .._base.locks import PlacementLock
from .._formats.files.checkpoint_files import INDEX, remove_checkpoint
from .._formats.files.delta_files import delta_prefix, write_delta_index
from .._formats.files.tensor_files import write_tensors
from .._formats.messages.checkpoint_operations import (
    MAX_WRITE_S,
    DeltaReply,
    DeltaTable,
    HurryDeltas,
    SaveDelta,
    TakeMark,
)
from .._variables.dynamic import DynamicEmbedding
from .object_graph import Entry, Graph

if TYPE_CHECKING:
    from .._transport.channels import Channel

logger = logging.getLogger("pstrain.checkpoint")

__all__ = [
    "Chain",
    "check_write_s",
    "index_marks",
    "next_seq",
    "placement_lock",
    "ps_channels",
    "publish_caught_up",
    "take_marks",
    "table_tag",
    "write_delta",
]


@dataclass
class Chain:
    """What the next delta extends (see the module docstring)."""

    base: str
    number: int
    seq: int
    marks: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: the variables (paths) and tables (names on the ps) its saves hold: a delta holds all
    #: of one not among them, or it is not written (a full save is)
    variables: frozenset[str] = frozenset()
    tables: frozenset[str] = frozenset()


def table_tag(path: str) -> str:
    """The short tag of a table's object-graph path in file names and keys."""
    return hashlib.blake2b(path.encode(), digest_size=6).hexdigest()


def ps_channels(entries: dict[str, Entry], tables: dict[str, DynamicEmbedding]) -> dict[int, Channel]:
    """The channel of every ps that holds a tracked value, by ps index."""
    out: dict[int, Channel] = {}
    for entry in entries.values():
        for part in entry.parts:
            if part.ps_index is not None:
                out.setdefault(part.ps_index, part.channel())
    for table in tables.values():
        for ps in table.holders():
            out.setdefault(ps, table.channel(ps))
    return out


def placement_lock(graph: Graph, shared: bool = False) -> contextlib.AbstractAsyncContextManager[Any]:
    """The lock that keeps moves of variables between ps (an elastic ps joining or leaving)
    out of a save or restore of ``graph``: its channels' (none if nothing is on a ps).
    ``shared``: with other saves (a delta is written while a compaction's base is)."""
    lock = _lock_of(graph)
    if lock is None:
        return contextlib.nullcontext()
    return lock.shared() if shared else lock


def _lock_of(graph: Graph) -> PlacementLock | None:
    for entry in graph.entries.values():
        for part in entry.parts:
            if part.ps_index is not None:
                return part.channels().session.placement_lock
    for table in graph.tables.values():
        return (table.pool if table.pool is not None else current_channels()).session.placement_lock
    return None


async def take_marks(channels: dict[int, Channel]) -> dict[int, tuple[str, int]]:
    """End the change epoch on each ps: what changes after the mark goes in the next delta."""
    replies = await asyncio.gather(*(ch.request(TakeMark()) for ch in channels.values()))
    return {ps: (r.incarnation, int(r.mark)) for ps, r in zip(channels, replies)}


def check_write_s(write_s: float, name: str = "write_s") -> None:
    """InvalidArgumentError unless ``write_s`` is a number of seconds a ps takes (0 to a day)."""
    if isinstance(write_s, bool) or not isinstance(write_s, (int, float)) or not 0 <= write_s <= MAX_WRITE_S:
        raise InvalidArgumentError(
            f"{name} must be a number of seconds from 0 (as fast as the "
            f"disk goes) to {MAX_WRITE_S:g}, got {write_s!r}"
        )


#: The last version this process gave a save, by directory (read from the directory once).
_LAST_SEQ: dict[str, int] = {}


def next_seq(directory: str) -> int:
    """A new version (``seq``) for a save in ``directory``: above every save there, full or
    delta, of any chain. Taken when the save starts, so versions follow the saves' marks."""
    directory = os.path.abspath(directory)
    last = _LAST_SEQ.get(directory)
    if last is None:
        last = directory_seq(directory)
    _LAST_SEQ[directory] = last + 1
    return last + 1


def index_marks(marks: dict[int, tuple[str, int]]) -> dict[str, list[Any]]:
    """Marks as an index records them (the serving feed compares them): ps -> [incarnation, mark]."""
    return {str(ps): [incarnation, mark] for ps, (incarnation, mark) in sorted(marks.items())}


def directory_seq(directory: str) -> int:
    """The highest save version (``seq``) of the checkpoints in ``directory`` (0: none)."""
    best = 0
    for path in glob.glob(os.path.join(glob.escape(directory), "*" + INDEX)):
        try:
            with open(path, "rb") as f:
                best = max(best, int(json.load(f).get("seq", 0)))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # not a pstrain index, or damaged: its reader says so when asked
    return best


async def write_delta(
    chain: Chain,
    entries: dict[str, Entry],
    tables: dict[str, DynamicEmbedding],
    table_slots: dict[str, str],
    write_s: float = 0.0,
    hurry: asyncio.Event | None = None,
) -> tuple[str, Chain]:
    """Write delta ``chain.number + 1`` of ``entries`` and ``tables`` (each ps spreading its
    file over about ``write_s`` seconds if > 0, the rest at once when ``hurry`` is set);
    returns its path and the chain it ends. FailedPreconditionError: a ps cannot give what
    changed since its mark (it restarted, or holds a value no save covers): a full
    checkpoint is needed."""
    check_write_s(write_s)
    number = chain.number + 1
    prefix = delta_prefix(chain.base, number)
    base = os.path.basename(prefix)
    channels = ps_channels(entries, tables)
    missing = sorted(set(channels) - set(chain.marks))
    if missing:
        raise FailedPreconditionError(f"ps {missing} hold values no save of {chain.base} covers")
    remove_checkpoint(prefix)  # an earlier attempt at this delta that never got its index
    variables: dict[int, dict[str, str]] = {ps: {} for ps in channels}
    where: dict[str, list[tuple[int | None, str, int, int]]] = {}
    local: dict[str, Any] = {}
    for path, entry in entries.items():
        for i, part in enumerate(entry.parts):
            rows = entry.offsets[i + 1] - entry.offsets[i]
            if part.ps_index is None:  # the coordinator's own: small, written whole
                arr = part.local_array()
                local[f"v:{path}#{i}:rows"] = arr
                if arr.ndim:
                    local[f"v:{path}#{i}:idx"] = np.arange(arr.shape[0], dtype=np.int64)
                where.setdefault(path, []).append((None, f"{path}#{i}", entry.offsets[i], rows))
            else:
                variables[part.ps_index][part.key] = part.key
                where.setdefault(path, []).append((part.ps_index, part.key, entry.offsets[i], rows))
    table_specs: dict[int, dict[str, DeltaTable]] = {ps: {} for ps in channels}
    for path, table in tables.items():
        for ps in table.holders():
            table_specs[ps][table.key] = DeltaTable(prefix=f"t-{table_tag(path)}", slots=table_slots)

    seq = next_seq(os.path.dirname(prefix))

    if hurry is not None and hurry.is_set():
        write_s = 0.0  # asked to hurry already: nothing to spread

    async def save(ps: int, channel: Channel) -> DeltaReply:
        incarnation, mark = chain.marks[ps]
        return await channel.request(
            SaveDelta(
                path=f"{prefix}.ps{ps}.safetensors",
                since=mark,
                incarnation=incarnation,
                variables=variables[ps],
                tables=table_specs[ps],
                write_s=write_s,
            )
        )

    # Every ps has finished (written or failed) before anything is cleaned up: a file still
    # being written when the first failure came back would be left behind otherwise.
    hurrying = (
        asyncio.get_running_loop().create_task(_hurry(hurry, channels))
        if hurry is not None and write_s > 0
        else None
    )
    try:
        outcomes = await asyncio.gather(
            *(save(ps, ch) for ps, ch in channels.items()), return_exceptions=True
        )
    finally:
        if hurrying is not None:
            hurrying.cancel()
    replies: dict[int, DeltaReply] = {}
    try:
        for ps, outcome in zip(channels, outcomes):
            if isinstance(outcome, BaseException):
                raise outcome
            replies[ps] = outcome
        if local:
            await asyncio.get_running_loop().run_in_executor(
                None, write_tensors, f"{prefix}.local.safetensors", local
            )
    except BaseException:
        remove_checkpoint(prefix)
        raise
    index_vars: dict[str, Any] = {}
    for path, parts in where.items():
        entry = entries[path]
        saved = []
        for holder, key, offset, nrows in parts:
            if holder is None:
                saved.append(
                    {
                        "file": f"{base}.local.safetensors",
                        "key": key,
                        "offset": offset,
                        "rows": nrows,
                        "whole": True,
                    }
                )
            elif key in replies[holder].written:
                saved.append(
                    {
                        "file": f"{base}.ps{holder}.safetensors",
                        "key": key,
                        "offset": offset,
                        "rows": nrows,
                        "whole": key in replies[holder].whole,
                    }
                )
        if saved:
            index_vars[path] = {
                "dtype": entry.dtype.str,
                "shape": list(entry.shape),
                "name": entry.name,
                "trainable": entry.trainable,
                "parts": saved,
            }
    whole = {
        table.key: all(table.key in replies[ps].whole_tables for ps in table.holders())
        for table in tables.values()
    }
    held = {  # the variables this delta holds all of
        path
        for path, parts in where.items()
        if all(holder is None or key in replies[holder].whole for holder, key, _, _ in parts)
    }
    partial = sorted(p for p in entries if p not in chain.variables and p not in held)
    partial += sorted(t.key for t in tables.values() if t.key not in chain.tables and not whole[t.key])
    if partial:  # (tracked after the base, made before it: what changed until then is in no save)
        remove_checkpoint(prefix)
        raise FailedPreconditionError(
            f"{partial} are in no save of {chain.base} and were made before its mark: a delta "
            "would hold only what changed since, so a full checkpoint is needed"
        )
    index_tables = {
        path: {
            "name": table.name,
            "key": table.key,
            # (as the full save's entry: a table made after the base is read from the
            # first delta that holds it, whole)
            "dim": table.dim,
            "dtype": table.dtype.name,
            "config": table.config,
            "whole": whole[table.key],
            "rows": sum(int(replies[ps].table_rows.get(table.key, 0)) for ps in table.holders()),
            "removed": sum(int(replies[ps].table_removed.get(table.key, 0)) for ps in table.holders()),
            "prefix": f"t-{table_tag(path)}",
            "files": [f"{base}.ps{ps}.safetensors" for ps in table.holders()],
        }
        for path, table in tables.items()
    }
    size = sum(int(r.bytes) for r in replies.values())
    rows = sum(int(r.rows) for r in replies.values())
    marks = {**chain.marks, **{ps: (r.incarnation, int(r.mark)) for ps, r in replies.items()}}
    index = {
        "base": os.path.basename(chain.base),
        "delta": number,
        "seq": seq,
        "time": time.time(),
        "variables": index_vars,
        "tables": index_tables,
        "bytes": size,
        "marks": index_marks(marks),
    }
    # Off the loop: its fsync can wait for the deltas' own bytes to reach the disk.
    await asyncio.get_running_loop().run_in_executor(None, write_delta_index, prefix, index)
    logger.info("saved delta %s (%d rows, %d bytes)", prefix, rows, size)
    return prefix, Chain(chain.base, number, seq, marks, chain.variables | held, chain.tables | whole.keys())


async def _hurry(hurry: asyncio.Event, channels: dict[int, Channel]) -> None:
    """Once ``hurry`` is set, ask each ps to write the rest of its spread delta at once."""
    await hurry.wait()
    for ps, outcome in zip(
        channels,
        await asyncio.gather(
            *(ch.request(HurryDeltas()) for ch in channels.values()), return_exceptions=True
        ),
    ):
        if isinstance(outcome, Exception):  # it writes at its pace: the delta just lands later
            logger.warning("ps %d was not told to write its delta at once: %s", ps, outcome)


async def publish_caught_up(
    chain: Chain,
    publish: Callable[[], None],
    lock: asyncio.Lock,
    catch_up: tuple[dict[str, Entry], dict[str, DynamicEmbedding], dict[str, str]] | None,
) -> Chain:
    """Make the full checkpoint of ``chain`` (its files written) visible: ``publish`` writes
    its index, off the loop (its fsync may wait). With ``catch_up`` (its entries, tables and
    table slots), delta 1 of it is written first, under ``lock`` (one delta at a time), so
    that it becomes the latest save already holding what changed while it was written: a
    large base takes seconds, and deltas of the chain before it went on meanwhile. Returns
    what the next delta extends. A catch-up delta that fails is logged; the next delta
    carries its rows."""
    loop = asyncio.get_running_loop()
    if catch_up is None:
        await loop.run_in_executor(None, publish)
        return chain
    async with lock:
        try:
            _, chain = await write_delta(chain, *catch_up)
        except Exception as exc:  # the base alone is still a good save
            logger.warning(
                "the delta written with checkpoint %s failed (the next one carries its rows): %s",
                chain.base,
                exc,
            )
        await loop.run_in_executor(None, publish)
    return chain
