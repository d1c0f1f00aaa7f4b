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
restore). ``load_variables(path)`` reads a checkpoint into numpy arrays
without any cluster.

>>> # manager = pstrain.checkpoint.CheckpointManager(ckpt, "/tmp/run", max_to_keep=3)
>>> # await manager.restore_or_initialize(); ...; await manager.save()
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import re
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, NotFoundError
from .optimizers import Optimizer
from .sharding import ShardedVariable
from .variables import Variable

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointManager", "load_variables"]

FORMAT = "pstrain-checkpoint"
INDEX = ".index.json"


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


def _index_path(path: str) -> str:
    return path if path.endswith(INDEX) else path + INDEX


def read_index(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` (the prefix ``save`` returned)."""
    try:
        with open(_index_path(path), encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError as exc:
        raise NotFoundError(f"no checkpoint at {path} (missing {_index_path(path)})") from exc
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"checkpoint index {_index_path(path)} is damaged: {exc}") from exc
    if index.get("format") != FORMAT:
        raise InvalidArgumentError(f"{_index_path(path)} is not a pstrain checkpoint")
    return index


def _write_json_atomically(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _sources(saved: dict[str, Any], base: str, start: int, stop: int, scalar: bool) -> list[list[Any]]:
    """Row ranges of the saved parts that cover rows ``[start, stop)`` of the variable."""
    parts = saved["parts"]
    whole = len(parts) == 1 and (scalar or (parts[0]["offset"] == start and parts[0]["rows"] == stop - start))
    if whole:
        return [[os.path.join(base, parts[0]["file"]), parts[0]["key"], None, None, None]]
    out = []
    for p in parts:
        lo, hi = max(start, p["offset"]), min(stop, p["offset"] + p["rows"])
        if lo < hi:
            out.append([os.path.join(base, p["file"]), p["key"], lo - p["offset"], hi - p["offset"], lo - start])
    return out


def read_variable(path: str, name: str) -> np.ndarray | None:
    """One variable of a checkpoint as a full array (None if it is not there)."""
    from .server.ps_files import read_rows

    meta = read_index(path)["variables"].get(name)
    if meta is None:
        return None
    base = os.path.dirname(os.path.abspath(_index_path(path)))
    shape = tuple(meta["shape"])
    return read_rows(shape, np.dtype(meta["dtype"]), _sources(meta, base, 0, shape[0] if shape else 1, not shape))


class Checkpoint:
    """Tracks variables reachable from its keyword arguments; saves and restores them."""

    def __init__(self, **objects: Any) -> None:
        self._objects = objects
        for key, value in objects.items():
            setattr(self, key, value)

    # -- save --------------------------------------------------------------------------------
    async def _flush(self, entries: dict[str, _Entry]) -> None:
        pending = {id(p._pending): p._pending for e in entries.values() for p in e.parts
                   if p._pending is not None}
        for strategy in pending.values():
            await strategy.flush()

    async def _slot_entries(self, entries: dict[str, _Entry], optimizers: list[Optimizer]) -> dict[str, _Entry]:
        """The optimizers' slots of tracked variables, as logical variables."""
        if not optimizers:
            return {}
        peers = next((p._peers for e in entries.values() for p in e.parts if p._peers is not None), None)
        if peers is None:
            return {}
        listing: dict[str, tuple[int, dict[str, Any]]] = {}
        for k in range(peers.cluster_spec.num_tasks("ps")):
            for v in (await peers.channel("ps", k).call("vars/list", {}))["variables"]:
                listing[v["name"]] = (k, v)
        out = {}
        for opt in optimizers:
            for entry in entries.values():
                for slot in opt.slot_names():
                    names = [f"{opt.name}/{slot}/{p.name}" for p in entry.parts]
                    if not all(n in listing for n in names):
                        continue
                    parts = [Variable._placed(n, tuple(listing[n][1]["shape"]), entry.dtype,
                                              listing[n][0], peers, False) for n in names]
                    name = f"{opt.name}/{slot}/{entry.name}"
                    out[name] = _Entry(name, parts, entry.offsets, entry.shape, entry.dtype, False)
        return out

    async def save(self, prefix: str) -> str:
        """Save every tracked variable under ``prefix``; returns the checkpoint path."""
        prefix = os.path.abspath(prefix)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        entries, optimizers = _collect(self._objects)
        await self._flush(entries)
        entries.update(await self._slot_entries(entries, optimizers))
        by_ps: dict[tuple[int, int], tuple[Variable, dict[str, str]]] = {}
        local: dict[str, np.ndarray] = {}
        index_vars: dict[str, Any] = {}
        base = os.path.basename(prefix)
        for entry in entries.values():
            parts_meta = []
            for i, part in enumerate(entry.parts):
                rows = entry.offsets[i + 1] - entry.offsets[i]
                if part.ps_index is None:
                    file = f"{base}.local.safetensors"
                    local[part.name] = part._local  # type: ignore[assignment]
                else:
                    file = f"{base}.ps{part.ps_index}.safetensors"
                    by_ps.setdefault((id(part._peers), part.ps_index), (part, {}))[1][part.name] = part.name
                parts_meta.append({"file": file, "key": part.name, "offset": entry.offsets[i], "rows": rows})
            index_vars[entry.name] = {"dtype": entry.dtype.str, "shape": list(entry.shape),
                                      "trainable": entry.trainable, "parts": parts_meta}

        async def save_ps(first: Variable, tensors: dict[str, str]) -> None:
            path = f"{prefix}.ps{first.ps_index}.safetensors"
            await first._channel().call("ckpt/save", {"path": path, "tensors": tensors})

        await asyncio.gather(*(save_ps(first, t) for first, t in by_ps.values()))
        if local:
            from .server.ps_files import write_tensors

            await asyncio.get_running_loop().run_in_executor(
                None, write_tensors, f"{prefix}.local.safetensors", local)
        _write_json_atomically(_index_path(prefix), {"format": FORMAT, "version": 1,
                                                     "variables": index_vars})
        logger.info("saved checkpoint %s (%d variables)", prefix, len(index_vars))
        return prefix

    # -- restore -------------------------------------------------------------------------------
    async def restore(self, path: str) -> Checkpoint:
        """Put the values saved at ``path`` into the tracked variables (re-creating lost ones).

        Variables created later through a strategy whose variables were restored here take
        their initial values from this checkpoint (delayed restore).
        """
        index = read_index(path)
        base = os.path.dirname(os.path.abspath(_index_path(path)))
        saved = index["variables"]
        entries, optimizers = _collect(self._objects)
        for opt in optimizers:  # slots of tracked variables, laid out like their variable
            for entry in list(entries.values()):
                for slot in opt.slot_names():
                    name = f"{opt.name}/{slot}/{entry.name}"
                    if name in saved:
                        parts = [Variable._placed(f"{opt.name}/{slot}/{p.name}", p.shape, p.dtype,
                                                  p.ps_index, p._peers, False) for p in entry.parts]
                        entries[name] = _Entry(name, parts, entry.offsets, entry.shape, entry.dtype, False)
        _register_delayed(entries, path)
        await self._flush(entries)
        by_ps: dict[tuple[int, int], tuple[Variable, list[dict[str, Any]]]] = {}
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
                sources = _sources(meta, base, entry.offsets[i], entry.offsets[i + 1], not entry.shape)
                if part.ps_index is None:
                    local.append((part, sources))
                    continue
                by_ps.setdefault((id(part._peers), part.ps_index), (part, []))[1].append(
                    {"name": part.name, "dtype": part.dtype.str, "shape": part.shape,
                     "trainable": part.trainable, "sources": sources})
        await asyncio.gather(*(first._channel().call("ckpt/restore", {"vars": specs})
                               for first, specs in by_ps.values()))
        if local:
            from .server.ps_files import read_rows

            for part, sources in local:
                part._local = read_rows(part.shape, part.dtype, sources)
        logger.info("restored checkpoint %s", path)
        return self

    async def read(self, path: str) -> Checkpoint:
        """Same as :meth:`restore` (TF's name for restoring without status bookkeeping)."""
        return await self.restore(path)


def _register_delayed(entries: dict[str, _Entry], path: str) -> None:
    """Variables created later (by these variables' strategies, or the current one) start
    from the values saved at ``path``."""
    from . import rpc

    peers = {id(p._peers): p._peers for e in entries.values() for p in e.parts if p._peers is not None}
    if rpc._default_peers is not None:
        peers[id(rpc._default_peers)] = rpc._default_peers
    for p in peers.values():
        owner = getattr(p, "owner", None)
        if owner is not None:
            owner._restore_from = path


def load_variables(path: str) -> dict[str, np.ndarray]:
    """Every variable of checkpoint ``path`` as a full numpy array, by name (no cluster needed).

    >>> # arrays = pstrain.checkpoint.load_variables("/tmp/run/ckpt-3")
    """
    from .server.ps_files import read_rows

    index = read_index(path)
    base = os.path.dirname(os.path.abspath(_index_path(path)))
    out = {}
    for name, meta in index["variables"].items():
        shape = tuple(meta["shape"])
        rows = shape[0] if shape else 1
        out[name] = read_rows(shape, np.dtype(meta["dtype"]), _sources(meta, base, 0, rows, not shape))
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
