"""Checkpoints keyed by the object graph: the same code restores the same state.

``Checkpoint(model=..., optimizer=..., step=...)`` tracks the variables
reachable from its objects (``object_graph.py``): Variables, ShardedVariables,
Modules, optimizers (``iterations`` and their slots on the ps), metrics, and
plain objects or containers holding them. Each is keyed by its *path* from the
checkpoint (``model/dense/kernel``; a slot by TF's
``model/dense/kernel/.OPTIMIZER_SLOT/optimizer/m``), never by its name, so a
second model in the same process, or one extra variable created first, restores
exactly what was saved. A sharded variable is one entry, so a checkpoint
restores into a different number of parts.

``await ckpt.save(prefix)`` writes ``<prefix>-<N>`` (``N`` counts this
checkpoint's saves, as TF's ``save_counter``); ``await ckpt.write(path)`` writes
exactly ``path``. Every ps writes the parts it holds at once (``<path>.ps<K>.safetensors``),
then the coordinator writes ``<path>.index.json`` last, atomically: a crash mid-save leaves the earlier
checkpoints intact and this one invisible. The ps write to the path the
coordinator gives, so on several machines the directory must be shared (as
with TensorFlow). No variable moves between ps during a save or restore.

``status = await ckpt.restore(path)`` puts every matching value back, all or
nothing across the ps, and returns a :class:`CheckpointLoadStatus`
(``assert_consumed()``, ``assert_existing_objects_matched()``,
``assert_nontrivial_match()``, ``expect_partial()``). Restoration is
*deferred* for what does not exist yet: a variable attached later to a
restored Module (or to the checkpoint) at a saved path, and the slots an
optimizer creates on its first ``apply_gradients``, take their saved values.
``load_variables(path)`` (``offline.py``) reads a checkpoint into numpy arrays, by
path, without any cluster.

A :class:`~pstrain.DynamicEmbedding` is saved by each ps as its own file
(``<path>.ps<K>.table-<tag>.safetensors``: ``ids``, ``rows`` and each
optimizer slot, with the slots' initial values), as of the moment that ps
copies it (a tiered shard restored from a checkpoint links that checkpoint's files
beside it rather than write their unchanged rows again: ``table_links.py``); restore
re-routes every id to the ps that holds it now, so a table restores into any number
of ps. Tables are staged with the variables (a restore is all
or nothing across the ps: ``_variables/staged_restore.py``), each ps's shard replaced
whole at the commit, with the table's capacity shared as a total; ``load_variables``
gives ``<path>/ids``, ``<path>/rows`` and ``<path>/slot:<optimizer>/<slot>``. The file format
is ``checkpoint_files.py``.

Format 1 checkpoints (keyed by variable name) are refused by ``restore``, which
says so; ``load_variables`` still reads them (by name).

::

    manager = pstrain.checkpoint.CheckpointManager(ckpt, "/tmp/run", max_to_keep=3)
    await manager.restore_or_initialize()
    ...
    await manager.save()
"""

from __future__ import annotations

import asyncio
import functools
import glob
import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.context import current_channels
from .._base.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from .._base.exports import expose
from .._formats.files.checkpoint_files import INDEX, CheckpointReader, make_parent, unwritten, write_index
from .._formats.files.delta_files import split_delta
from .._formats.files.tensor_files import write_tensors
from .._formats.messages.checkpoint_operations import SaveCheckpoint, TableShardFile
from .._formats.messages.operations import ListVariables
from .._formats.messages.records import VariableInfo
from .._formats.numerics.optimizer_rules import slot_shape
from .._variables.batched import ensure_created
from .._variables.dynamic import DynamicEmbedding
from .._variables.placement import Placement
from .._variables.staged_restore import new_stage
from .._variables.variables import Variable
from .deltas import (
    Chain,
    index_marks,
    next_seq,
    placement_lock,
    ps_channels,
    publish_caught_up,
    table_tag,
    take_marks,
    write_delta,
)
from .object_graph import Entry, Graph, check_trackable, slot_key, table_slots, walk
from .restore_status import CheckpointLoadStatus, targets

if TYPE_CHECKING:
    from .._transport.channels import Channel, ChannelPool

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointLoadStatus", "recent_saves"]


class Checkpoint:
    """Tracks the objects given (and attributes set later); saves and restores their state by path."""

    _objects: dict[str, Any]
    _status: CheckpointLoadStatus | None
    _chain: Chain | None  # what the next delta extends (deltas.py)
    _delta_lock: asyncio.Lock  # one delta at a time (a full save's catch-up delta too)
    #: Saves made by :meth:`save` (restored from the checkpoint's index, as TF's counter).
    save_counter: int

    def __init__(self, root: Any = None, **objects: Any) -> None:
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "_status", None)
        object.__setattr__(self, "_chain", None)
        object.__setattr__(self, "_delta_lock", asyncio.Lock())
        object.__setattr__(self, "save_counter", 0)
        if root is not None:
            objects = {"root": root, **objects}
        for key, value in objects.items():
            setattr(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name != "save_counter":
            check_trackable(name, value)  # before anything changes
        object.__setattr__(self, name, value)
        if name.startswith("_") or name == "save_counter":
            return
        self._objects[name] = value
        status = self._status
        if status is not None:
            status.attached("", name, value)

    def tracked_objects(self) -> dict[str, Any]:
        """The objects this checkpoint tracks, by attribute name."""
        return dict(self._objects)

    # -- save --------------------------------------------------------------------------------
    async def _slot_entries(self, graph: Graph) -> dict[str, Entry]:
        """The optimizers' slots of tracked variables that exist on the ps, as entries."""
        placed = [p for e in graph.entries.values() for p in e.parts if p.ps_index is not None]
        if not graph.optimizers or not placed:
            return {}
        pool = _channel_pool(placed[0])
        listing: dict[str, tuple[int, VariableInfo]] = {}
        for k in pool.session.routes.active():  # (not a ps that left the job: an elastic ps)
            for v in (await pool.channel("ps", k).request(ListVariables())).variables:
                listing[v.name] = (k, v)
        out = {}
        for opt_path, opt in graph.optimizers.items():
            for path, entry in graph.entries.items():
                for slot in opt.slot_names():
                    names = [opt.slot_variable_name(p, slot) for p in entry.parts]
                    if not all(n in listing for n in names):
                        continue
                    parts = [
                        Variable.handle(
                            n, tuple(listing[n][1].shape), entry.dtype, listing[n][0], pool, False
                        )
                        for n in names
                    ]
                    key = slot_key(path, opt_path, slot)
                    out[key] = Entry(
                        key,
                        f"{opt.name}/{slot}/{entry.name}",
                        parts,
                        entry.offsets,
                        slot_shape(opt.kind, entry.shape),
                        entry.dtype,
                        False,
                    )
        return out

    async def save(self, file_prefix: str, options: Any = None) -> str:
        """Save to ``<file_prefix>-<N>`` (``N`` = ``save_counter`` + 1); returns that path.
        ``options`` (TF's ``CheckpointOptions``: I/O devices, async writes) has no effect."""
        object.__setattr__(self, "save_counter", self.save_counter + 1)
        return await self.write(f"{file_prefix}-{self.save_counter}")

    async def write(self, file_prefix: str, options: Any = None, *, catch_up: bool = False) -> str:
        """Save every tracked variable (and optimizer slot) at exactly ``file_prefix``;
        ``catch_up``: with its delta 1 (``deltas.publish_caught_up``). ``options``, TF's, has
        no effect."""
        return await self._write(file_prefix, compacted=False, catch_up=catch_up)

    async def write_compacted(self, file_prefix: str, *, catch_up: bool = False) -> str:
        """:meth:`write`, as the base that folds the current chain's deltas in: it covers the
        changes up to the chain's last delta (its marks), not up to now, so a table feed reader
        at that delta goes on from the new base's deltas without a full read
        (``_formats/files/table_feed.py``). Write a delta just before. Without a chain in the same
        directory, the same as :meth:`write`."""
        return await self._write(file_prefix, compacted=True, catch_up=catch_up)

    async def _write(self, file_prefix: str, compacted: bool, catch_up: bool) -> str:
        # No variable moves between ps meanwhile; deltas go on (they share the lock).
        async with placement_lock(walk(self._objects), shared=True):
            return await self._write_now(file_prefix, compacted, catch_up)

    async def _write_now(self, file_prefix: str, compacted: bool, catch_up: bool) -> str:
        prefix = os.path.abspath(file_prefix)
        make_parent(prefix)
        if os.path.lexists(prefix + INDEX):
            raise AlreadyExistsError(
                f"checkpoint {prefix} exists; a checkpoint is never written over (save to another path)"
            )
        _clear_unfinished(prefix)
        graph, entries = await self._entries()
        seq = next_seq(os.path.dirname(prefix))
        channels = ps_channels(entries, graph.tables)
        chain = self._chain
        if (
            compacted
            and chain is not None
            and os.path.dirname(chain.base) == os.path.dirname(prefix)
            and set(channels) <= set(chain.marks)
        ):
            marks = {ps: chain.marks[ps] for ps in channels}  # older marks: more written, nothing missed
        else:
            marks = await take_marks(channels)  # before: nothing missed
        by_ps: dict[int, tuple[Channel, dict[str, str], list[TableShardFile]]] = {}
        local: dict[str, np.ndarray] = {}
        index_vars: dict[str, Any] = {}
        base = os.path.basename(prefix)
        for path, entry in entries.items():
            parts_meta = []
            for i, part in enumerate(entry.parts):
                rows = entry.offsets[i + 1] - entry.offsets[i]
                if part.ps_index is None:
                    file = f"{base}.local.safetensors"
                    key = f"{path}#{i}"
                    local[key] = part.local_array()
                else:
                    file = f"{base}.ps{part.ps_index}.safetensors"
                    key = part.key
                    by_ps.setdefault(part.ps_index, (part.channel(), {}, []))[1][key] = part.key
                parts_meta.append({"file": file, "key": key, "offset": entry.offsets[i], "rows": rows})
            index_vars[path] = {
                "dtype": entry.dtype.str,
                "shape": list(entry.shape),
                "name": entry.name,
                "trainable": entry.trainable,
                "parts": parts_meta,
            }
        # A ps's table shards go in its one ckpt/save: taken at the same moment as its variables.
        index_tables: dict[str, Any] = {}
        slots = table_slots(graph)  # by optimizer path, as the variables' slots
        for path, table in graph.tables.items():
            holders = table.holders()
            files = [f"{base}.ps{ps}.table-{table_tag(path)}.safetensors" for ps in holders]
            for ps, f in zip(holders, files):
                await table.shard_ready(ps)
                by_ps.setdefault(ps, (table.channel(ps), {}, []))[2].append(
                    TableShardFile(name=table.key, path=os.path.join(os.path.dirname(prefix), f), slots=slots)
                )
            index_tables[path] = {
                "name": table.name,
                "key": table.key,
                "dim": table.dim,
                "dtype": table.dtype.name,
                "config": table.config,
                "files": files,
            }

        answers = await asyncio.gather(
            *(
                ch.request(
                    SaveCheckpoint(path=f"{prefix}.ps{ps}.safetensors", tensors=tensors, tables=shards)
                )
                for ps, (ch, tensors, shards) in by_ps.items()
            ),
            return_exceptions=True,
        )
        replies = [r for r in answers if not isinstance(r, BaseException)]
        if len(replies) < len(answers):  # once every ps is done: what the others wrote is no checkpoint
            _clear_unfinished(prefix, "a ps could not write its part")
            raise next(r for r in answers if isinstance(r, BaseException))
        for meta in index_tables.values():
            meta["rows"] = sum(int(r.table_rows.get(meta["key"], 0)) for r in replies)
        if local:
            await asyncio.get_running_loop().run_in_executor(
                None, write_tensors, f"{prefix}.local.safetensors", local
            )
        publish = functools.partial(
            write_index,
            prefix,
            index_vars,
            self.save_counter,
            index_tables,
            seq,
            index_marks(marks),
            linked=any(r.table_links for r in replies),
        )
        held = frozenset(index_vars), frozenset(t.key for t in graph.tables.values())
        saved = Chain(prefix, 0, seq, marks, *held)
        try:
            new = await publish_caught_up(
                saved,
                publish,
                self._delta_lock,
                (entries, graph.tables, slots) if catch_up else None,
            )
        except OSError as exc:  # (the index is written atomically: there is none)
            _clear_unfinished(prefix, "its index could not be written")
            raise unwritten(prefix + INDEX, exc) from None
        object.__setattr__(self, "_chain", new)
        _SAVED.append(
            {"path": prefix, "time": time.time(), "values": len(index_vars), "tables": len(index_tables)}
        )
        logger.info("saved checkpoint %s (%d values)", prefix, len(index_vars))
        return prefix

    async def _entries(self) -> tuple[Graph, dict[str, Entry]]:
        """The tracked values now (created first), with their optimizers' slots."""
        graph = walk(self._objects)
        entries = dict(graph.entries)
        await ensure_created(p for e in entries.values() for p in e.parts)
        entries.update(await self._slot_entries(graph))
        return graph, entries

    async def write_delta(self, *, write_s: float = 0.0, hurry: asyncio.Event | None = None) -> str:
        """Write what changed since the last save or delta of this checkpoint's chain as the
        chain's next delta (``<base>.delta-<K>``); returns its path. The last full save or
        restore by this object is the base. FailedPreconditionError if there is none, or a
        ps cannot give its changes (it restarted): write a full checkpoint then. ``write_s``,
        ``hurry``: the spread of each ps's file (``CheckpointManager``, ``deltas.write_delta``)."""
        chain = self._chain
        if chain is None:
            raise FailedPreconditionError(
                "a delta extends a full checkpoint written or restored "
                "by this Checkpoint, and there is none yet: save first"
            )
        async with placement_lock(walk(self._objects), shared=True), self._delta_lock:  # a save's order
            chain = self._chain or chain  # a full save may have moved the chain on meanwhile
            graph, entries = await self._entries()
            path, new = await write_delta(chain, entries, graph.tables, table_slots(graph), write_s, hurry)
        if self._chain is chain:  # not superseded meanwhile by a full save or a restore
            object.__setattr__(self, "_chain", new)
        _SAVED.append(
            {"path": path, "time": time.time(), "values": len(entries), "tables": len(graph.tables)}
        )
        return path

    @property
    def chain_base(self) -> str | None:
        """The full checkpoint the next delta extends (None: no save or restore yet)."""
        return self._chain.base if self._chain else None

    # -- restore -------------------------------------------------------------------------------
    async def restore(self, save_path: str | None, options: Any = None) -> CheckpointLoadStatus:
        """Put the values saved at ``save_path`` back into the objects at the same paths.

        All or nothing across the ps. Returns a :class:`CheckpointLoadStatus`; objects
        attached later at saved paths, and optimizer slots created later, are restored
        when they appear. ``save_path=None`` restores nothing (TF's initialization-only
        status, whose assertions fail). ``options``, TF's, has no effect.
        """
        if save_path is None:
            return CheckpointLoadStatus(self, None, Graph())
        async with placement_lock(walk(self._objects)):
            return await self._restore(save_path)

    async def _restore(self, save_path: str) -> CheckpointLoadStatus:
        reader = CheckpointReader(save_path)  # the index is read and checked once, here
        if reader.keyed_by != "path":
            raise InvalidArgumentError(
                f"checkpoint {save_path} was written by an older pstrain that keyed variables by "
                "name (format 1); names are not stable across programs, so it is not restored by "
                "path. Read it with pstrain.checkpoint.load_variables(path) (arrays by name) and "
                "assign them, then save again to get a format 2 checkpoint."
            )
        graph = walk(self._objects)
        status = CheckpointLoadStatus(self, reader, graph)
        tables = _check_tables(graph.tables, reader, save_path)  # before anything changes
        stage, slots = new_stage(), {v: k for k, v in table_slots(graph).items()}
        staged = [
            (
                table,
                *table.restore_requests(
                    [os.path.join(reader.base, f) for f in reader.tables[path]["files"]],
                    slots,
                    reader.table_deltas(path),
                    stage,
                ),
            )
            for path, table in tables
        ]
        # the variables and the tables, all or nothing: every ps reads and checks its part first
        await status.restore_now(targets(graph, reader.variables, graph.entries, {}), staged, stage)
        for table, requests, _ in staged:
            table.restored_on(requests)
        for path, optimizer in graph.optimizers.items():  # a save older than the mirror
            mirrored = optimizer.iterations_mirror is not None
            if mirrored and f"{path}/iterations_mirror" not in reader.variables:
                await optimizer.mirror_iterations()
        split = split_delta(os.path.abspath(save_path))
        base, number = split if split else (os.path.abspath(save_path), 0)
        marks = await take_marks(ps_channels(graph.entries, graph.tables))  # after: restored
        chain = Chain(
            base, number, reader.seq, marks, frozenset(reader.variables), frozenset(t.key for _, t in tables)
        )
        object.__setattr__(self, "_chain", chain)
        status.watch(graph.modules)
        old = self._status
        if old is not None:
            old.expect_partial()  # superseded: its leftovers are this restore's business now
        object.__setattr__(self, "_status", status)
        object.__setattr__(self, "save_counter", max(self.save_counter, reader.save_counter))
        missing = [p for p in graph.entries if p not in reader.variables]
        if missing:
            logger.warning(
                "checkpoint %s has no value for %d tracked variable(s), which keep their current values: %s",
                save_path,
                len(missing),
                ", ".join(missing[:10]),
            )
        logger.info("restored checkpoint %s", save_path)
        return status

    async def read(self, save_path: str, options: Any = None) -> CheckpointLoadStatus:
        """Restore from a checkpoint written by :meth:`write` (same as :meth:`restore`)."""
        return await self.restore(save_path)


#: The checkpoints this process saved, newest last (the dashboard lists them).
_SAVED: deque[dict[str, Any]] = deque(maxlen=50)


def recent_saves() -> list[dict[str, Any]]:
    """The checkpoints this process saved lately: path, time, values and tables."""
    return list(_SAVED)


def _clear_unfinished(prefix: str, why: str = "its process died before the index was written") -> None:
    """Remove the files of a save at ``prefix`` that never finished (``why``: the index was
    never written, the checkpoint never visible): what a failed save wrote takes no disk
    (a full one, say), and a job restarted from an earlier checkpoint can save there again."""
    stale = [
        f
        for e in (".ps*.safetensors", ".local.safetensors", ".delta-*")
        for f in glob.glob(glob.escape(prefix) + e)
    ]
    for path in stale:
        os.remove(path)
    if stale:
        logger.warning("removed %d file(s) of an unfinished save at %s (%s)", len(stale), prefix, why)


def _check_tables(
    tables: dict[str, DynamicEmbedding], reader: CheckpointReader, save_path: str
) -> list[tuple[str, DynamicEmbedding]]:
    """The tracked dynamic tables the checkpoint has, each checked against what was saved."""
    out = []
    for path, table in tables.items():
        saved = reader.tables.get(path)
        if saved is None:
            logger.warning("checkpoint %s has no dynamic table at %s; it keeps its rows", save_path, path)
            continue
        if saved["dim"] != table.dim or np.dtype(saved["dtype"]) != table.dtype:
            raise InvalidArgumentError(
                f"checkpoint {save_path}: the dynamic table at {path!r} was saved {saved['dim']} "
                f"wide of {saved['dtype']}; this one is {table.dim} wide of {table.dtype.name}"
            )
        out.append((path, table))
    return out


def _channel_pool(part: Variable) -> ChannelPool:
    """The channel pool a placed variable uses (its placement's, else the closure's)."""
    creator = part.creator
    if isinstance(creator, Placement) and creator.channels is not None:
        return creator.channels
    return current_channels()


expose(globals(), "pstrain.checkpoint")
