"""Checkpoint files written and read by the ps, where the variables live.

``ckpt/save`` writes the named variables to one safetensors file (under a
temporary name, fsynced, then renamed). The arrays are *pinned* meanwhile, so
training goes on: an update to a pinned array copies it first. ``ckpt/restore``
builds variables from row ranges of checkpoint files (a sharded variable may
have been saved in a different number of parts) and puts them in place,
creating the ones that do not exist (a restarted ps starts empty).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidArgumentError, NotFoundError

if TYPE_CHECKING:
    from .ps import ParameterServer

__all__ = ["read_rows", "write_tensors"]


def write_tensors(path: str, tensors: dict[str, np.ndarray]) -> int:
    """Write ``tensors`` to ``path`` atomically (temp file, fsync, rename); returns bytes."""
    from safetensors.numpy import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


def read_rows(shape: tuple[int, ...], dtype: np.dtype, sources: list[list[Any]]) -> np.ndarray:
    """Assemble an array from ``[file, key, src_start, src_stop, dst_start]`` row ranges."""
    from safetensors import safe_open

    out = np.empty(shape, dtype)
    filled = 0
    for path, key, start, stop, dst in sources:
        try:
            with safe_open(path, "np") as f:
                if start is None:
                    piece = f.get_tensor(key)
                else:
                    piece = f.get_slice(key)[start:stop]
        except FileNotFoundError as exc:
            raise NotFoundError(f"checkpoint file {path} not found") from exc
        except Exception as exc:  # safetensors raises its own types for bad files and keys
            raise InvalidArgumentError(f"cannot read {key!r} from {path}: {exc}") from exc
        if start is None:
            if piece.shape != tuple(shape) and piece.size == out.size:
                piece = piece.reshape(shape)  # safetensors returns 0-d tensors as shape (1,)
            if piece.shape != tuple(shape):
                raise InvalidArgumentError(f"{key!r} in {path} has shape {piece.shape}, expected {shape}")
            out[...] = piece
            filled = out.shape[0] if out.ndim else 1
        else:
            out[dst:dst + (stop - start)] = piece
            filled += stop - start
    expected = shape[0] if len(shape) else 1
    if filled != expected:
        raise InvalidArgumentError(f"checkpoint sources cover {filled} of {expected} rows")
    return out


async def save(server: ParameterServer, req: dict[str, Any]) -> dict[str, Any]:
    path = req["path"]
    names = req["tensors"]  # key in the file -> variable name here
    slots = {key: server._slot(name) for key, name in names.items()}
    releases = [s.pin() for s in slots.values()]
    try:
        arrays = {key: s.array for key, s in slots.items()}
        loop = asyncio.get_running_loop()
        size = await loop.run_in_executor(None, write_tensors, path, arrays)
    finally:
        for release in releases:
            release()
    return {"path": path, "bytes": size}


async def restore(server: ParameterServer, req: dict[str, Any]) -> dict[str, Any]:
    from .ps import _Slot

    specs = req["vars"]
    loop = asyncio.get_running_loop()

    def build() -> list[tuple[str, np.ndarray, bool]]:
        out = []
        for spec in specs:
            dtype = np.dtype(spec["dtype"])
            out.append((spec["name"], read_rows(tuple(spec["shape"]), dtype, spec["sources"]),
                        bool(spec.get("trainable", True))))
        return out

    built = await loop.run_in_executor(None, build)
    for name, array, _ in built:  # check everything before changing anything
        slot = server.vars.get(name)
        if slot is not None and (slot.array.shape != array.shape or slot.array.dtype != array.dtype):
            raise InvalidArgumentError(
                f"checkpoint value for {name!r} is {array.shape} {array.dtype}, the variable "
                f"is {slot.array.shape} {slot.array.dtype}")
    for name, array, trainable in built:
        slot = server.vars.get(name)
        if slot is None:
            server.vars[name] = _Slot(name, array, trainable)
        else:
            slot.replace(array)
    return {"restored": len(built)}
