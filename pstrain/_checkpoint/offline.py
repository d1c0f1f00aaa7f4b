"""A checkpoint read without a cluster: :func:`load_variables` gives every value as a numpy
array (:func:`list_variables` their names and shapes, :func:`load_variable` one of them, as
TF's ``tf.train`` functions), by object-graph path (by name for a format 1 checkpoint), and
each dynamic table as its ids, rows and slots. The files are read by
``_formats/files/checkpoint_files.py``; nothing here talks to a ps.
"""

from __future__ import annotations

import os

import numpy as np

from .._base.errors import NotFoundError
from .._base.exports import expose
from .._formats.files.checkpoint_files import CheckpointReader
from .manager import latest_checkpoint

__all__ = ["list_variables", "load_variable", "load_variables"]


def load_variables(path: str) -> dict[str, np.ndarray]:
    """Every value of checkpoint ``path`` (or of the newest in directory ``path``) as a full
    numpy array, by object-graph path (``model/dense/kernel``; by name for a format 1
    checkpoint). No cluster needed.

    ``arrays = pstrain.checkpoint.load_variables("/tmp/run/ckpt-3")``
    """
    reader = CheckpointReader(_checkpoint_at(path))
    out = {}
    for name in reader.variables:
        array = reader.read(name)
        assert array is not None  # every name comes from the index
        out[name] = array
    for name in reader.tables:  # a dynamic table: <path>/ids, <path>/rows, <path>/slot:<key>
        for key, array in reader.read_table(name).items():
            out[f"{name}/{key}"] = array
    return out


def list_variables(ckpt_dir_or_file: str) -> list[tuple[str, list[int]]]:
    """TF's ``tf.train.list_variables``: ``(name, shape)`` of every value of a checkpoint (or
    of the newest in a directory), sorted by name, the names :func:`load_variables` gives.
    A variable's shape comes from the index; a dynamic table's arrays are read to count
    their rows."""
    reader = CheckpointReader(_checkpoint_at(ckpt_dir_or_file))
    out = [(name, [int(d) for d in meta["shape"]]) for name, meta in reader.variables.items()]
    for name in reader.tables:
        out += [(f"{name}/{key}", list(array.shape)) for key, array in reader.read_table(name).items()]
    return sorted(out)


def load_variable(ckpt_dir_or_file: str, name: str) -> np.ndarray:
    """TF's ``tf.train.load_variable``: one value of a checkpoint (or of the newest in a
    directory) by the name :func:`list_variables` gives; NotFoundError naming the ones
    there are if it has no such value."""
    reader = CheckpointReader(_checkpoint_at(ckpt_dir_or_file))
    if name in reader.variables:
        array = reader.read(name)
        assert array is not None
        return array
    table, _, key = name.rpartition("/")
    if table in reader.tables:
        arrays = reader.read_table(table)
        if key in arrays:
            return arrays[key]
    known = sorted(reader.variables) + sorted(f"{t}/..." for t in reader.tables)
    raise NotFoundError(f"checkpoint {reader.path} has no value {name!r}; it has {known[:20]}")


def _checkpoint_at(path: str) -> str:
    """``path``, or the newest checkpoint in directory ``path`` (as TF's readers take one)."""
    if os.path.isdir(path):
        latest = latest_checkpoint(path)
        if latest is None:
            raise NotFoundError(f"no checkpoint in directory {path}")
        return latest
    return path


expose(globals(), "pstrain.checkpoint")
