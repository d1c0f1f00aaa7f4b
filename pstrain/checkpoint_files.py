"""The checkpoint file format, written by the ps and the coordinator, read by both.

A checkpoint ``<prefix>`` is

* ``<prefix>.ps<K>.safetensors``: the parts ps K holds, written by that ps
  (``<prefix>.local.safetensors`` for variables local to the coordinator);
* ``<prefix>.index.json``: written last, atomically, by the coordinator: for
  each logical variable its dtype, shape and the row ranges of its parts
  (``{"file", "key", "offset", "rows"}``). A checkpoint without its index
  does not exist.

A reader asks for rows ``[start, stop)`` of a variable and gets *sources*
(``[file, key, src_start, src_stop, dst_start]``) that :func:`read_rows`
assembles, so a variable saved in 4 parts restores into 2, or into 1.
No network here; file I/O only.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, NotFoundError

__all__ = ["FORMAT", "INDEX", "index_path", "read_index", "read_rows", "sources",
           "write_index", "write_tensors"]

FORMAT = "pstrain-checkpoint"
INDEX = ".index.json"


def index_path(path: str) -> str:
    """The index file of checkpoint ``path`` (a prefix, or the index itself).

    >>> index_path("/tmp/run/ckpt-3")
    '/tmp/run/ckpt-3.index.json'
    """
    return path if path.endswith(INDEX) else path + INDEX


def checkpoint_dir(path: str) -> str:
    """The directory that holds checkpoint ``path``'s files."""
    return os.path.dirname(os.path.abspath(index_path(path)))


def read_index(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` (the prefix ``save`` returned)."""
    try:
        with open(index_path(path), encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError as exc:
        raise NotFoundError(f"no checkpoint at {path} (missing {index_path(path)})") from exc
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"checkpoint index {index_path(path)} is damaged: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise InvalidArgumentError(f"{index_path(path)} is not a pstrain checkpoint")
    return index


def write_index(prefix: str, variables: dict[str, Any]) -> None:
    """Write the index of checkpoint ``prefix`` atomically (temp file, fsync, rename)."""
    path = index_path(prefix)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "version": 1, "variables": variables}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sources(saved: dict[str, Any], base: str, start: int, stop: int, scalar: bool) -> list[list[Any]]:
    """Row ranges of the saved parts of one variable that cover its rows ``[start, stop)``."""
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
    """One variable of checkpoint ``path`` as a full array (None if it is not there)."""
    meta = read_index(path)["variables"].get(name)
    if meta is None:
        return None
    shape = tuple(meta["shape"])
    return read_rows(shape, np.dtype(meta["dtype"]),
                     sources(meta, checkpoint_dir(path), 0, shape[0] if shape else 1, not shape))


def write_tensors(path: str, tensors: dict[str, np.ndarray]) -> int:
    """Write ``tensors`` to ``path`` atomically (temp file, fsync, rename); returns bytes."""
    from safetensors.numpy import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


def read_rows(shape: tuple[int, ...], dtype: np.dtype, parts: list[list[Any]]) -> np.ndarray:
    """Assemble an array from ``[file, key, src_start, src_stop, dst_start]`` row ranges."""
    from safetensors import safe_open

    out = np.empty(shape, dtype)
    filled = 0
    for path, key, start, stop, dst in parts:
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
