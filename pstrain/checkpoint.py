"""Checkpoints: every tracked variable, saved where it lives, restorable anywhere.

``Checkpoint(model=..., optimizer=..., step=...)`` tracks the variables
reachable from its objects: Variables, ShardedVariables, Modules, optimizers
(``iterations`` and their slots on the ps), metrics, and plain objects or
containers holding them. Variables are keyed by name (a sharded variable by its
logical name), so a checkpoint restores into a fresh process or a restarted ps
that builds the same model, and into a different number of parts.

``await ckpt.save(prefix)`` writes ``<prefix>.ps<K>.safetensors`` on every ps
at once (each ps writes the parts it holds), then ``<prefix>.index.json`` last,
atomically (temporary file, fsync, rename): a crash mid-save leaves the earlier
checkpoints intact and this one invisible. The ps write to the same path the
coordinator gives, so on several machines the directory must be shared (as
with TensorFlow).

``await ckpt.restore(path)`` puts the saved values back, each ps reading the
row ranges of its parts itself; variables the ps has lost are re-created.
Variables created *after* a restore take their initial value from it (delayed
restore, through the strategy's placement). ``load_variables(path)`` reads a
checkpoint into numpy arrays without any cluster. The file format is
``checkpoint_files.py``, shared with the ps.

::

    manager = pstrain.checkpoint.CheckpointManager(ckpt, "/tmp/run", max_to_keep=3)
    await manager.restore_or_initialize()
    ...
    await manager.save()
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import secrets
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .checkpoint_files import (
    INDEX,
    CheckpointReader,
    read_rows,
    sources,
    write_index,
    write_tensors,
)
from .context import current_channels
from .errors import InvalidArgumentError
from .optimizers import Optimizer
from .placement import Placement
from .sharding import ShardedVariable
from .variables import Variable, current_creator, ensure_created

if TYPE_CHECKING:
    from .rpc import Channel, ChannelPool

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointManager", "load_variables"]


@dataclass
class _Entry:
    """One logical variable: its parts (in row order) and their row offsets."""

    name: str
    parts: list[Variable]
    offsets: list[int]
    shape: tuple[int, ...]
    dtype: np.dtype
    trainable: bool


def _entry(v: Variable | ShardedVariable) -> _Entry:
    if isinstance(v, ShardedVariable):
        return _Entry(v.name, v.variables, [int(o) for o in v.offsets], v.shape, v.dtype, v.trainable)
    rows = v.shape[0] if v.shape else 1
    return _Entry(v.name, [v], [0, rows], v.shape, v.dtype, v.trainable)


_SKIP = (types.ModuleType, types.FunctionType, type, np.ndarray)


def _collect(objects: dict[str, Any]) -> tuple[dict[str, _Entry], list[Optimizer]]:
    entries: dict[str, _Entry] = {}
    optimizers: list[Optimizer] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, _SKIP):
            return
        seen.add(id(obj))
        if isinstance(obj, (Variable, ShardedVariable)):
            entries[obj.name] = _entry(obj)
            return
        if isinstance(obj, Optimizer):
            optimizers.append(obj)
            walk(obj.iterations)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v)
        elif hasattr(obj, "__dict__") and not type(obj).__module__.startswith(
                ("pstrain.strategy", "pstrain.coordinator", "pstrain.rpc", "pstrain.launch")):
            for v in vars(obj).values():
                walk(v)

    for obj in objects.values():
        walk(obj)
    return entries, optimizers


class Checkpoint:
    """Tracks variables reachable from its keyword arguments; saves and restores them."""

    def __init__(self, **objects: Any) -> None:
        self._objects = objects
        for key, value in objects.items():
            setattr(self, key, value)

    # -- save --------------------------------------------------------------------------------
    async def _slot_entries(self, entries: dict[str, _Entry], optimizers: list[Optimizer]) -> dict[str, _Entry]:
        """The optimizers' slots of tracked variables, as logical variables."""
        if not optimizers:
            return {}
        placed = [p for e in entries.values() for p in e.parts if p.ps_index is not None]
        if not placed:
            return {}
        pool = _channel_pool(placed[0])
        listing: dict[str, tuple[int, dict[str, Any]]] = {}
        for k in range(pool.cluster_spec.num_tasks("ps")):
            for v in (await pool.channel("ps", k).call("vars/list", {}))["variables"]:
                listing[v["name"]] = (k, v)
        out = {}
        for opt in optimizers:
            for entry in entries.values():
                for slot in opt.slot_names():
                    names = [f"{opt.name}/{slot}/{p.name}" for p in entry.parts]
                    if not all(n in listing for n in names):
                        continue
                    parts = [Variable.handle(n, tuple(listing[n][1]["shape"]), entry.dtype,
                                             listing[n][0], pool, False) for n in names]
                    name = f"{opt.name}/{slot}/{entry.name}"
                    out[name] = _Entry(name, parts, entry.offsets, entry.shape, entry.dtype, False)
        return out

    async def save(self, prefix: str) -> str:
        """Save every tracked variable under ``prefix``; returns the checkpoint path."""
        prefix = os.path.abspath(prefix)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        entries, optimizers = _collect(self._objects)
        await ensure_created(p for e in entries.values() for p in e.parts)
        entries.update(await self._slot_entries(entries, optimizers))
        by_ps: dict[Channel, tuple[int, dict[str, str]]] = {}
        local: dict[str, np.ndarray] = {}
        index_vars: dict[str, Any] = {}
        base = os.path.basename(prefix)
        for entry in entries.values():
            parts_meta = []
            for i, part in enumerate(entry.parts):
                rows = entry.offsets[i + 1] - entry.offsets[i]
                if part.ps_index is None:
                    file = f"{base}.local.safetensors"
                    local[part.name] = part.local_array()
                else:
                    file = f"{base}.ps{part.ps_index}.safetensors"
                    by_ps.setdefault(part.channel(), (part.ps_index, {}))[1][part.name] = part.name
                parts_meta.append({"file": file, "key": part.name, "offset": entry.offsets[i], "rows": rows})
            index_vars[entry.name] = {"dtype": entry.dtype.str, "shape": list(entry.shape),
                                      "trainable": entry.trainable, "parts": parts_meta}

        async def save_ps(channel: Channel, ps: int, tensors: dict[str, str]) -> None:
            path = f"{prefix}.ps{ps}.safetensors"
            await channel.call("ckpt/save", {"path": path, "tensors": tensors})

        await asyncio.gather(*(save_ps(ch, ps, t) for ch, (ps, t) in by_ps.items()))
        if local:
            await asyncio.get_running_loop().run_in_executor(
                None, write_tensors, f"{prefix}.local.safetensors", local)
        write_index(prefix, index_vars)
        logger.info("saved checkpoint %s (%d variables)", prefix, len(index_vars))
        return prefix

    # -- restore -------------------------------------------------------------------------------
    async def restore(self, path: str) -> Checkpoint:
        """Put the values saved at ``path`` into the tracked variables (re-creating lost ones).

        Variables created later through a strategy whose variables were restored here take
        their initial values from this checkpoint (delayed restore).
        """
        reader = CheckpointReader(path)  # the index is read and checked once, here
        base = reader.base
        saved = reader.variables
        entries, optimizers = _collect(self._objects)
        for opt in optimizers:  # slots of tracked variables, laid out like their variable
            for entry in list(entries.values()):
                for slot in opt.slot_names():
                    name = f"{opt.name}/{slot}/{entry.name}"
                    if name in saved:
                        parts = [_slot_handle(f"{opt.name}/{slot}/{p.name}", p) for p in entry.parts]
                        entries[name] = _Entry(name, parts, entry.offsets, entry.shape, entry.dtype, False)
        _register_delayed(entries, reader)
        await ensure_created(p for e in entries.values() for p in e.parts)
        by_ps: dict[Channel, list[dict[str, Any]]] = {}
        local: list[tuple[Variable, list[list[Any]]]] = []
        for name, entry in entries.items():
            meta = saved.get(name)
            if meta is None:
                continue
            if tuple(meta["shape"]) != entry.shape or np.dtype(meta["dtype"]) != entry.dtype:
                raise InvalidArgumentError(
                    f"checkpoint {path}: {name!r} was saved as {tuple(meta['shape'])} {meta['dtype']}, "
                    f"the variable is {entry.shape} {entry.dtype}")
            for i, part in enumerate(entry.parts):
                rows = sources(meta, base, entry.offsets[i], entry.offsets[i + 1], not entry.shape)
                if part.ps_index is None:
                    local.append((part, rows))
                    continue
                by_ps.setdefault(part.channel(), []).append(
                    {"name": part.name, "dtype": part.dtype.str, "shape": part.shape,
                     "trainable": part.trainable, "sources": rows})
        local_values = [(part, read_rows(part.shape, part.dtype, rows)) for part, rows in local]
        await _restore_all_or_nothing(by_ps)
        for part, value in local_values:
            await part.assign(value)
        logger.info("restored checkpoint %s", path)
        return self

    async def read(self, path: str) -> Checkpoint:
        """Same as :meth:`restore` (TF's name for restoring without status bookkeeping)."""
        return await self.restore(path)


async def _restore_all_or_nothing(by_ps: dict[Channel, list[dict[str, Any]]]) -> None:
    """Every ps reads and checks its part of the checkpoint (staged), then all commit; if
    one fails, the others drop what they staged and nothing changes anywhere."""
    stage = secrets.token_hex(8)
    channels = list(by_ps)
    staged = await asyncio.gather(*(ch.call("ckpt/restore", {"vars": by_ps[ch], "stage": stage})
                                    for ch in channels), return_exceptions=True)
    failed = [r for r in staged if isinstance(r, BaseException)]
    if failed:
        await asyncio.gather(*(ch.call("ckpt/abort", {"stage": stage}) for ch in channels),
                             return_exceptions=True)
        raise failed[0]
    await asyncio.gather(*(ch.call("ckpt/commit", {"stage": stage}) for ch in channels))


def _channel_pool(part: Variable) -> ChannelPool:
    """The channel pool a placed variable uses (its placement's, else the closure's)."""
    creator = part.creator
    if isinstance(creator, Placement) and creator.channels is not None:
        return creator.channels
    return current_channels()


def _slot_handle(name: str, part: Variable) -> Variable:
    """A handle to the optimizer slot ``name`` laid out like ``part`` (on the same ps)."""
    assert part.ps_index is not None
    creator = part.creator
    pool = creator.channels if isinstance(creator, Placement) else None
    return Variable.handle(name, part.shape, part.dtype, part.ps_index, pool, False)


def _register_delayed(entries: dict[str, _Entry], reader: CheckpointReader) -> None:
    """Variables created later (by the placements of these variables, or of the scope this
    runs in) start from the values ``reader``'s checkpoint saved."""
    placements: dict[int, Placement] = {}
    for e in entries.values():
        for p in e.parts:
            if isinstance(p.creator, Placement):
                placements[id(p.creator)] = p.creator
    current = current_creator()
    if isinstance(current, Placement):
        placements[id(current)] = current
    for placement in placements.values():
        placement.restore_new_variables_from(reader.read)


def load_variables(path: str) -> dict[str, np.ndarray]:
    """Every variable of checkpoint ``path`` as a full numpy array, by name (no cluster needed).

    ``arrays = pstrain.checkpoint.load_variables("/tmp/run/ckpt-3")``
    """
    reader = CheckpointReader(path)
    out = {}
    for name in reader.variables:
        array = reader.read(name)
        assert array is not None  # every name comes from the index
        out[name] = array
    return out


class CheckpointManager:
    """Numbered checkpoints ``<directory>/<checkpoint_name>-<N>`` keeping the last ``max_to_keep``."""

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt") -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise InvalidArgumentError("max_to_keep must be positive (or None to keep all)")
        self.checkpoint = checkpoint
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name
        self._pattern = re.compile(re.escape(checkpoint_name) + r"-(\d+)" + re.escape(INDEX) + "$")

    def _numbers(self) -> list[int]:
        found = []
        for path in glob.glob(os.path.join(glob.escape(self.directory), f"{self.checkpoint_name}-*{INDEX}")):
            m = self._pattern.search(os.path.basename(path))
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, f"{self.checkpoint_name}-{number}")

    @property
    def checkpoints(self) -> list[str]:
        """The complete checkpoints kept, oldest first."""
        return [self._path(n) for n in self._numbers()]

    @property
    def latest_checkpoint(self) -> str | None:
        numbers = self._numbers()
        return self._path(numbers[-1]) if numbers else None

    async def save(self, checkpoint_number: int | None = None) -> str:
        """Save the next checkpoint (or number ``checkpoint_number``) and drop old ones."""
        numbers = self._numbers()
        number = checkpoint_number if checkpoint_number is not None else (numbers[-1] + 1 if numbers else 1)
        path = await self.checkpoint.save(self._path(number))
        if self.max_to_keep is not None:
            for old in self._numbers()[:-self.max_to_keep]:
                self._delete(old)
        return path

    def _delete(self, number: int) -> None:
        prefix = self._path(number)
        os.remove(prefix + INDEX)  # first: the checkpoint stops being visible
        for path in glob.glob(glob.escape(prefix) + ".*"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    async def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint if there is one; returns its path, else None."""
        latest = self.latest_checkpoint
        if latest is not None:
            await self.checkpoint.restore(latest)
        return latest
