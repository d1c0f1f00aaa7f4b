"""The ps's side of checkpoints: write the variables it holds, build them back.

``ckpt/save`` writes the named variables to one safetensors file (under a
temporary name, fsynced, then renamed; ``checkpoint_files.py``). The arrays
are *pinned* meanwhile, so training goes on: an update to a pinned array
copies it first. ``ckpt/restore`` builds variables from row ranges of
checkpoint files (a sharded variable may have been saved in a different
number of parts), checks them all, then puts them in place, creating the
ones that do not exist (a restarted ps starts empty).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..checkpoint_files import read_rows, write_tensors
from ..errors import InvalidArgumentError
from .store import VariableStore

__all__ = ["restore", "save"]


async def save(store: VariableStore, req: dict[str, Any]) -> dict[str, Any]:
    """``{"path", "tensors": {key in the file: variable name}}`` -> ``{"path", "bytes"}``."""
    path = req["path"]
    names = req["tensors"]
    records = {key: store.get(name) for key, name in names.items()}
    releases = [r.pin() for r in records.values()]
    try:
        arrays = {key: r.array for key, r in records.items()}
        size = await asyncio.get_running_loop().run_in_executor(None, write_tensors, path, arrays)
    finally:
        for release in releases:
            release()
    return {"path": path, "bytes": size}


async def restore(store: VariableStore, req: dict[str, Any]) -> dict[str, Any]:
    """``{"vars": [{"name", "dtype", "shape", "trainable", "sources"}]}``, all or nothing."""
    specs = req["vars"]

    def build() -> list[tuple[str, np.ndarray, bool]]:
        return [(spec["name"], read_rows(tuple(spec["shape"]), np.dtype(spec["dtype"]), spec["sources"]),
                 bool(spec.get("trainable", True))) for spec in specs]

    built = await asyncio.get_running_loop().run_in_executor(None, build)
    for name, array, _ in built:  # check everything before changing anything
        record = store.find(name)
        if record is not None and (record.array.shape != array.shape or record.array.dtype != array.dtype):
            raise InvalidArgumentError(
                f"checkpoint value for {name!r} is {array.shape} {array.dtype}, the variable "
                f"is {record.array.shape} {record.array.dtype}")
    for name, array, trainable in built:
        store.put(name, array, trainable)
    return {"restored": len(built)}
