"""A checkpoint read without a cluster: :func:`load_variables` gives every value as a numpy
array, by object-graph path (by name for a format 1 checkpoint), and each dynamic table as
its ids, rows and slots. The files are read by ``_formats/files/checkpoint_files.py``; nothing
here talks to a ps.
"""

from __future__ import annotations

import numpy as np

from .._base.exports import expose
from .._formats.files.checkpoint_files import CheckpointReader

__all__ = ["load_variables"]


def load_variables(path: str) -> dict[str, np.ndarray]:
    """Every value of checkpoint ``path`` as a full numpy array, by object-graph path
    (``model/dense/kernel``; by name for a format 1 checkpoint). No cluster needed.

    ``arrays = pstrain.checkpoint.load_variables("/tmp/run/ckpt-3")``
    """
    reader = CheckpointReader(path)
    out = {}
    for name in reader.variables:
        array = reader.read(name)
        assert array is not None  # every name comes from the index
        out[name] = array
    for name in reader.tables:  # a dynamic table: <path>/ids, <path>/rows, <path>/slot:<key>
        for key, array in reader.read_table(name).items():
            out[f"{name}/{key}"] = array
    return out


expose(globals(), "pstrain.checkpoint")
